"""The Llama MLP of a many-row step under bf16 products on CPU, bf16 from gate_up to down.

Under `cpu_gemm_dtype bfloat16` each quantized product's result is bf16 (oneDNN), and the Python
layers widened gate_up's [tokens, 2 * intermediate] to float32, ran torch's SiLU and multiply over
it, then rounded the product back to bf16 for down: after this round's other changes about a fifth
of a bf16 prefill of SmolLM2, all of it memory traffic. Here gate_up's bf16 result goes through
SiLU * up in one compiled pass (native_rows.c) into down's bf16 input. The values are the other
path's up to SiLU's exponential (within 2 ulp of torch's), so this runs only where the products
are bf16 already; float32 (exact), LoRA, biases, tensor parallelism and other weight formats take
the layers as before.
"""
from __future__ import annotations

import torch

from pdserve.kernels import dequant_tiles, native_gemv
from pdserve.layers.linear import LinearBase
from pdserve.layers.quant.grouped import GroupedLinearMethod

MIN_ROWS = native_gemv.MAX_TOKENS + 1  # up to MAX_TOKENS rows the compiled gemv takes each product


def gate_up_silu_down(gate_up: LinearBase, down: LinearBase, x: torch.Tensor,
                      keep_bf16: bool = False) -> torch.Tensor | None:
    """down(SiLU(gate) * up) of x [tokens, hidden] float32, gate_up's rows [gate | up]; None where
    this path does not apply (the caller runs its layers). keep_bf16 (layers/bf16_rows.py): x may
    be the norm's rows rounded to bf16 already, and down's result is returned bf16, not widened."""
    if not _applies(gate_up, down, x, keep_bf16):
        return None
    inter = down.input_size
    gate_up_rows = gate_up.quant_method.packed(gate_up)
    down_rows = down.quant_method.packed(down)
    if gate_up_rows.native is None or down_rows.native is None:
        return None
    both = dequant_tiles.bf16_product(x, gate_up_rows.native, 2 * inter, keep_bf16=True)
    if both is None:
        return None
    act = torch.empty(x.shape[0], inter, dtype=torch.bfloat16)
    if native_gemv.library().pd_silu_mul_bf16(both.data_ptr(), x.shape[0], inter, act.data_ptr(),
                                              torch.get_num_threads()) != 0:
        return None
    return dequant_tiles.bf16_product(act, down_rows.native, sum(down.output_sizes), keep_bf16=keep_bf16)


def _applies(gate_up: LinearBase, down: LinearBase, x: torch.Tensor, bf16_rows: bool) -> bool:
    # (where int8 products take these rows, the layers' own path takes 4- and 8-bit matrices
    # through the int8 kernel)
    return (dequant_tiles.tile_dtype() == torch.bfloat16 and not dequant_tiles.int8_products(x.shape[0])
            and x.device.type == "cpu" and (x.dtype == torch.float32 or bf16_rows and x.dtype == torch.bfloat16)
            and x.dim() == 2 and x.shape[0] >= MIN_ROWS and x.is_contiguous()
            and all(isinstance(layer.quant_method, GroupedLinearMethod) and layer.lora is None
                    and layer.bias is None and layer.tp.size == 1 for layer in (gate_up, down)))
