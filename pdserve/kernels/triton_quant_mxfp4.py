"""MXFP4 MoE experts (gpt-oss) as two grouped GEMMs in Triton, the weights unpacked in registers:
the layout pdserve.models.moe_quant.Mxfp4Experts holds, bytes [E, rows, cols / 2] with two e2m1
codes each (the low nibble first) and one uint8 power of two (biased by 127) per 32 columns.
Activations stay float (weight-only). CPU under TRITON_INTERPRET=1 in tests.

The tiles are triton_moe's; each K tile is one 32-column group, so a row's scale is one value
per tile. An e2m1 code s·e·e·m is (-1)^s · m / 2 for e = 0, else (-1)^s · (2 + m) · 2^(e - 2):
exact in float32, as the scale's power of two is.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import mxfp4_cpu
from pdserve.kernels.triton_moe import BLOCK_M, tile_layout

GROUP = 32


@triton.jit
def _mxfp4_grouped_kernel(x, q, sc, bias, out, pair_ids, tile_expert, route_w, num_experts, n_out, k_in, top_k,
                          s_xm, s_xk, s_qe, s_qn, s_qk, s_se, s_sn, s_sk, s_be, s_om, s_on,
                          GATHER_TOKENS: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_ROUTE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    tile, n_tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_expert + tile).to(tl.int64)
    if expert >= num_experts:
        return
    pairs = tl.load(pair_ids + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    ok = pairs >= 0
    pairs = tl.where(ok, pairs, 0).to(tl.int64)
    if GATHER_TOKENS:
        rows = pairs // top_k
    else:
        rows = pairs
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, k_in // GROUP):
        k = kb * GROUP + tl.arange(0, GROUP)
        a = tl.load(x + rows[:, None] * s_xm + k[None, :] * s_xk, mask=ok[:, None], other=0.0).to(tl.float32)
        packed = tl.load(q + expert * s_qe + n[None, :] * s_qn + (k // 2)[:, None] * s_qk,
                         mask=n_ok[None, :], other=0)
        code = (packed >> ((k % 2) * 4)[:, None].to(tl.uint8)) & 15
        mag, m = (code >> 1) & 3, (code & 1).to(tl.float32)
        value = tl.where(mag == 0, m * 0.5, (2.0 + m) * tl.exp2(mag.to(tl.float32) - 2.0))
        value = tl.where(code >= 8, -value, value)
        scale = tl.load(sc + expert * s_se + n * s_sn + kb * s_sk, mask=n_ok, other=127).to(tl.float32)
        acc += tl.dot(a, value * tl.exp2(scale - 127.0)[None, :], input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias + expert * s_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if MUL_ROUTE:
        acc *= tl.load(route_w + pairs, mask=ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out + pairs[:, None] * s_om + n[None, :] * s_on, acc, mask=ok[:, None] & n_ok[None, :])


def _grouped(x, q, scales, bias, pair_ids, tile_expert, route_w, pairs, top_k, gather_tokens):
    num_experts, n_out, k_in = q.shape[0], q.shape[1], q.shape[2] * 2
    out = torch.zeros(pairs, n_out, dtype=torch.float32, device=x.device)
    block_n = 64 if n_out >= 64 else max(16, triton.next_power_of_2(n_out))
    grid = (tile_expert.numel(), triton.cdiv(n_out, block_n))
    _mxfp4_grouped_kernel[grid](
        x, q, scales, bias if bias is not None else x, out, pair_ids, tile_expert,
        route_w if route_w is not None else x, num_experts, n_out, k_in, top_k, *x.stride(), *q.stride(),
        *scales.stride(), bias.stride(0) if bias is not None else 0, *out.stride(),
        GATHER_TOKENS=gather_tokens, HAS_BIAS=bias is not None, MUL_ROUTE=route_w is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, GROUP=GROUP)
    return out


def mxfp4_fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                        gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor, activation,
                        gate_up_bias: torch.Tensor | None = None,
                        down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H]; ids, weights [T, K]; gate_up uint8 [E, 2I, H / 2], gate_up_scale uint8
    [E, 2I, H / 32]; down [E, H, I / 2], down_scale [E, H, I / 32] -> [T, H] in x's dtype."""
    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    pair_ids, tile_expert = tile_layout(ids, gate_up.shape[0])
    pairs = tokens * top_k
    h = _grouped(x, gate_up, gate_up_scale, gate_up_bias, pair_ids, tile_expert, None, pairs, top_k, True)
    h = activation(h)
    route_w = weights.reshape(-1).to(torch.float32).contiguous()
    y = _grouped(h, down, down_scale, down_bias, pair_ids, tile_expert, route_w, pairs, top_k, False)
    return y.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


def mxfp4_experts_reference(x, ids, weights, gate_up, gate_up_scale, down, down_scale, activation,
                            gate_up_bias=None, down_bias=None) -> torch.Tensor:
    """The same on CPU: each expert's weights dequantized (mxfp4_cpu.dequantize), in float32 torch."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32)
    for expert in ids.unique().tolist():
        token, slot = (ids == expert).nonzero(as_tuple=True)
        h = x[token].float() @ mxfp4_cpu.dequantize(gate_up[expert], gate_up_scale[expert]).t()
        h = activation(h + (gate_up_bias[expert].float() if gate_up_bias is not None else 0))
        y = h @ mxfp4_cpu.dequantize(down[expert], down_scale[expert]).t()
        y = y + (down_bias[expert].float() if down_bias is not None else 0)
        out.index_add_(0, token, y * weights[token, slot].float()[:, None])
    return out
