"""The Llama layers of a many-row step under bf16 products on CPU, bf16 between the norms and the products.

Under `cpu_gemm_dtype` bfloat16 (and int8's many rows) each product rounds its float32
input to bf16 and widens its bf16 result to float32. Between a layer's norms and its four products
that was four passes over [tokens, hidden] a layer, and the norms read and wrote float32 rows the
products only rounded: about a tenth of a 2,048-token prefill of SmolLM2. Here each norm rounds
the rows it writes (numba_fused.rms_norm_low: the words the products' rounding made), qkv and
gate_up take them as they are, and o's and down's bf16 results go to the next norm's residual add
as they are (it widens them, exactly). The values are the other path's, bit for bit: it runs only
where every layer's four products are one bf16 pass each (step_takes, bf16_mlp.one_bf16_pass: a
quantized matrix's whole tile, an unquantized one's oneDNN pass past its AMX tiles' rows), and a
product that declines here takes its layer with the rows widened back (exact), as before.
"""
from __future__ import annotations

import torch

from pdserve.kernels import dequant_tiles
from pdserve.layers.bf16_mlp import MIN_ROWS, bf16_linear, one_bf16_pass
from pdserve.layers.linear import LinearBase


def step_takes(layers, x: torch.Tensor, fused) -> bool:
    """Whether this step's layers (each with self_attn.qkv_proj / o_proj and mlp.gate_up_proj /
    down_proj) run bf16 between norms and products: many rows under bf16 tile products, a fused
    module whose norm rounds (numba_fused.takes_low), every product a bf16 tile product."""
    takes_low = getattr(fused, "takes_low", None)
    if (takes_low is None or x.shape[0] < MIN_ROWS or dequant_tiles.tile_dtype() != torch.bfloat16
            or dequant_tiles.int8_products(x.shape[0]) or not takes_low(x)):
        return False
    return all(one_bf16_pass(linear, x.shape[0]) for layer in layers for linear in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))


def projection(linear: LinearBase, x: torch.Tensor, keep_bf16: bool) -> torch.Tensor:
    """linear(x) for x float32 or the norm's bf16 rows: bf16 where keep_bf16 (for the next norm's
    residual add), float32 otherwise; the layer itself, with x widened, where the tile declines."""
    out = bf16_linear(linear, x, keep_bf16)
    return out if out is not None else linear(x.float())
