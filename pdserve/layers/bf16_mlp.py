"""The Llama MLP of a many-row step under bf16 products on CPU, bf16 from gate_up to down.

Under `cpu_gemm_dtype bfloat16` each product's result is bf16 (oneDNN), and the Python
layers widened gate_up's [tokens, 2 * intermediate] to float32, ran torch's SiLU and multiply over
it, then rounded the product back to bf16 for down: after this round's other changes about a fifth
of a bf16 prefill of SmolLM2, all of it memory traffic. Here gate_up's bf16 result goes through
SiLU * up in one compiled pass (native_rows.c) into down's bf16 input. The values are the other
path's up to SiLU's exponential (within 2 ulp of torch's), so this runs only where the products
are bf16 already: a quantized matrix's whole-matrix tile, or an unquantized one's oneDNN pass (past
the rows its AMX tiles take, layers/quant/unquantized.py). Float32 (exact), LoRA, biases, tensor
parallelism and other weight formats take the layers as before.
"""
from __future__ import annotations

import torch

from pdserve.kernels import dequant_tiles, native_gemv
from pdserve.layers.linear import LinearBase
from pdserve.layers.quant import unquantized
from pdserve.layers.quant.grouped import GroupedLinearMethod

MIN_ROWS = native_gemv.MAX_TOKENS + 1  # up to MAX_TOKENS rows the compiled gemv takes each product


def gate_up_silu_down(gate_up: LinearBase, down: LinearBase, x: torch.Tensor,
                      keep_bf16: bool = False) -> torch.Tensor | None:
    """down(SiLU(gate) * up) of x [tokens, hidden] float32, gate_up's rows [gate | up]; None where
    this path does not apply (the caller runs its layers). keep_bf16 (layers/bf16_rows.py): x may
    be the norm's rows rounded to bf16 already, and down's result is returned bf16, not widened."""
    if not _applies(gate_up, down, x, keep_bf16):
        return None
    both = bf16_linear(gate_up, x, keep_bf16=True)
    if both is None:
        return None
    act = dequant_tiles.silu_mul_bf16(both)
    return None if act is None else bf16_linear(down, act, keep_bf16=keep_bf16)


def one_bf16_pass(linear: LinearBase, rows: int) -> bool:
    """Whether the layer's product of `rows` rows is one bf16 pass that takes bf16 rows and can
    return its result unwidened (bf16_linear): a quantized matrix's whole-matrix tile past the
    compiled kernel's rows or an unquantized one's oneDNN pass past its AMX tiles' rows, with
    nothing added to the result (no LoRA, no bias, no tensor parallelism)."""
    if linear.lora is not None or linear.bias is not None or linear.tp.size != 1:
        return False
    method = linear.quant_method
    if isinstance(method, unquantized.UnquantizedLinearMethod):
        return unquantized.bf16_pass_takes(linear, rows)
    if not isinstance(method, GroupedLinearMethod):
        return False
    # up to max_tokens rows the compiled kernel takes a quantized matrix's products (quant_cpu), each
    # task's rows dequantized in cache: on AMX's tiles a 128-token prefill step of the default GGUF
    # ran 11% faster there than through whole-matrix tiles and oneDNN, a 192-token one 7%
    return (method.packed(linear).native is not None and rows > native_gemv.max_tokens()
            and sum(linear.output_sizes) * linear.input_size * 2 <= dequant_tiles.BF16_TILE_BYTES)


def bf16_linear(linear: LinearBase, x: torch.Tensor, keep_bf16: bool) -> torch.Tensor | None:
    """linear(x) for x float32 or bf16 rows, in the one pass of one_bf16_pass: bf16 where keep_bf16,
    else float32; None where the tile declines."""
    if isinstance(linear.quant_method, unquantized.UnquantizedLinearMethod):
        return unquantized.bf16_product(linear, x, keep_bf16)
    rows = linear.quant_method.packed(linear)
    return dequant_tiles.bf16_product(x, rows.native, sum(linear.output_sizes), keep_bf16=keep_bf16)


def _applies(gate_up: LinearBase, down: LinearBase, x: torch.Tensor, bf16_rows: bool) -> bool:
    # (where int8 products take these rows, the layers' own path takes 4- and 8-bit matrices
    # through the int8 kernel)
    return (dequant_tiles.tile_dtype() == torch.bfloat16 and not dequant_tiles.int8_products(x.shape[0])
            and x.device.type == "cpu" and (x.dtype == torch.float32 or bf16_rows and x.dtype == torch.bfloat16)
            and x.dim() == 2 and x.shape[0] >= MIN_ROWS and x.is_contiguous()
            and all(one_bf16_pass(layer, x.shape[0]) for layer in (gate_up, down)))
