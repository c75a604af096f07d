"""The Llama layers of a many-row step under bf16 products on CPU, bf16 between the norms and the products.

Under `cpu_gemm_dtype` bfloat16 (and int8's many rows) each quantized product rounds its float32
input to bf16 and widens its bf16 result to float32. Between a layer's norms and its four products
that was four passes over [tokens, hidden] a layer, and the norms read and wrote float32 rows the
products only rounded: about a tenth of a 2,048-token prefill of SmolLM2. Here each norm rounds
the rows it writes (numba_fused.rms_norm_low: the words the products' rounding made), qkv and
gate_up take them as they are, and o's and down's bf16 results go to the next norm's residual add
as they are (it widens them, exactly). The values are the other path's, bit for bit: it runs only
where every layer's four products are bf16 tile products of one tile (step_takes), and a product
that declines here takes its layer with the rows widened back (exact), as before.
"""
from __future__ import annotations

import torch

from pdserve.kernels import dequant_tiles
from pdserve.layers.bf16_mlp import MIN_ROWS
from pdserve.layers.linear import LinearBase
from pdserve.layers.quant.grouped import GroupedLinearMethod


def step_takes(layers, x: torch.Tensor, fused) -> bool:
    """Whether this step's layers (each with self_attn.qkv_proj / o_proj and mlp.gate_up_proj /
    down_proj) run bf16 between norms and products: many rows under bf16 tile products, a fused
    module whose norm rounds (numba_fused.takes_low), every product a bf16 tile product."""
    takes_low = getattr(fused, "takes_low", None)
    if (takes_low is None or x.shape[0] < MIN_ROWS or dequant_tiles.tile_dtype() != torch.bfloat16
            or dequant_tiles.int8_products(x.shape[0]) or not takes_low(x)):
        return False
    return all(_one_tile(linear) for layer in layers for linear in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))


def _one_tile(linear: LinearBase) -> bool:
    """A quantized matrix whose bf16 product runs as one tile (dequant_tiles.bf16_product), with
    nothing added to its result: no LoRA, no bias, no tensor parallelism."""
    if (not isinstance(linear.quant_method, GroupedLinearMethod) or linear.lora is not None
            or linear.bias is not None or linear.tp.size != 1):
        return False
    packed = linear.quant_method.packed(linear)
    return packed.native is not None and sum(linear.output_sizes) * linear.input_size * 2 <= dequant_tiles.BF16_TILE_BYTES


def projection(linear: LinearBase, x: torch.Tensor, keep_bf16: bool) -> torch.Tensor:
    """linear(x) for x float32 or the norm's bf16 rows: bf16 where keep_bf16 (for the next norm's
    residual add), float32 otherwise; the layer itself, with x widened, where the tile declines."""
    rows = linear.quant_method.packed(linear)
    out = dequant_tiles.bf16_product(x, rows.native, sum(linear.output_sizes), keep_bf16=keep_bf16)
    return out if out is not None else linear(x.float())
