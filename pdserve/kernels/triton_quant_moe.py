"""FP8 block-scaled MoE experts as two grouped GEMMs in Triton (DeepSeek-V3's routed experts,
laid out as pdserve.models.moe_quant.Fp8Experts holds them: e4m3 bytes [E, N, K] with act_quant's
per-row scales [E, N, ceil(K / block)]). CPU under TRITON_INTERPRET=1 in tests.

The tiles are triton_moe's (pdserve.kernels.triton_moe.tile_layout: each tile of BLOCK_M
(token, expert) pairs belongs to one expert, built on the device). The activations are quantized
per token in groups of `block` columns once, before the gate_up launch, and the activation's
output again before the down launch; each K tile is one column block, so the pair's activation
scale and the expert row's weight scale multiply the tile's FP8 dot product inside the K loop.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_moe import BLOCK_M, tile_layout
from pdserve.kernels.triton_quant import fp8_block_reference, per_token_group_quant_fp8


@triton.jit
def _fp8_grouped_kernel(x, xs, w, ws, out, pair_ids, tile_expert, route_w, num_experts, n_out, k_in, top_k,
                        s_xm, s_xk, s_xsm, s_xsk, s_we, s_wn, s_wk, s_wse, s_wsn, s_wsk, s_om, s_on,
                        GATHER_TOKENS: tl.constexpr, MUL_ROUTE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile, n_tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_expert + tile).to(tl.int64)
    if expert >= num_experts:  # tiles past the last expert's
        return
    pairs = tl.load(pair_ids + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    ok = pairs >= 0
    pairs = tl.where(ok, pairs, 0).to(tl.int64)
    if GATHER_TOKENS:  # the input row: the pair's token (gate_up), or the pair's own (down)
        rows = pairs // top_k
    else:
        rows = pairs
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(k_in, BLOCK_K)):
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < k_in
        xq = tl.load(x + rows[:, None] * s_xm + k[None, :] * s_xk, mask=ok[:, None] & k_ok[None, :], other=0.0)
        wq = tl.load(w + expert * s_we + n[None, :] * s_wn + k[:, None] * s_wk,
                     mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        x_scale = tl.load(xs + rows * s_xsm + kb * s_xsk, mask=ok, other=0.0)
        w_scale = tl.load(ws + expert * s_wse + n * s_wsn + kb * s_wsk, mask=n_ok, other=0.0)
        acc += tl.dot(xq, wq) * x_scale[:, None] * w_scale[None, :]
    if MUL_ROUTE:
        acc *= tl.load(route_w + pairs, mask=ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out + pairs[:, None] * s_om + n[None, :] * s_on, acc, mask=ok[:, None] & n_ok[None, :])


def _grouped(x, w, w_scale, block, pair_ids, tile_expert, route_w, pairs, top_k, gather_tokens):
    num_experts, n_out, k_in = w.shape
    xq, x_scale = per_token_group_quant_fp8(x, block)
    out = torch.zeros(pairs, n_out, dtype=torch.float32, device=x.device)
    block_n = 64 if n_out >= 64 else max(16, triton.next_power_of_2(n_out))
    grid = (tile_expert.numel(), triton.cdiv(n_out, block_n))
    _fp8_grouped_kernel[grid](
        xq, x_scale, w, w_scale, out, pair_ids, tile_expert, route_w if route_w is not None else x_scale,
        num_experts, n_out, k_in, top_k, *xq.stride(), *x_scale.stride(), *w.stride(), *w_scale.stride(),
        *out.stride(), GATHER_TOKENS=gather_tokens, MUL_ROUTE=route_w is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block)
    return out


def fp8_fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                      gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor, block: int,
                      activation) -> torch.Tensor:
    """x [T, H]; ids, weights [T, K]; gate_up [E, 2I, H] and down [E, H, I] float8_e4m3fn (or
    bytes); their scales float32 [E, rows, column blocks] -> [T, H] in x's dtype."""
    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    gate_up, down = (t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 else t for t in (gate_up, down))
    pair_ids, tile_expert = tile_layout(ids, gate_up.shape[0])
    pairs = tokens * top_k
    h = _grouped(x, gate_up, gate_up_scale, block, pair_ids, tile_expert, None, pairs, top_k, True)
    h = activation(h)
    route_w = weights.reshape(-1).to(torch.float32).contiguous()
    y = _grouped(h, down, down_scale, block, pair_ids, tile_expert, route_w, pairs, top_k, False)
    return y.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


def fp8_experts_reference(x, ids, weights, gate_up, gate_up_scale, down, down_scale, block, activation):
    """The same in torch: each (token, expert) pair through fp8_block_reference, one expert at a time."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32)
    for expert in ids.unique().tolist():
        token, slot = (ids == expert).nonzero(as_tuple=True)
        h = activation(fp8_block_reference(x[token].float(), gate_up[expert], gate_up_scale[expert], block))
        y = fp8_block_reference(h, down[expert], down_scale[expert], block)
        out.index_add_(0, token, y * weights[token, slot].float()[:, None])
    return out
