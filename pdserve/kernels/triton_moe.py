"""Mixture-of-experts as two grouped GEMMs in Triton: the GPU path of models.moe.Experts (CPU
under TRITON_INTERPRET=1 in tests).

A step's (token, expert) pairs are sorted by expert and laid out in tiles of BLOCK_M rows, each
tile holding one expert's pairs (an expert's last tile padded with -1). One launch multiplies
every tile by its expert's gate_up weights (rows gathered from the tokens), the activation runs
in torch, a second launch multiplies by the down weights and by each pair's routing weight, and
the K pairs of each token are summed. The tile layout is built on the device with a fixed
upper bound on the tile count, so nothing waits for the host and a step can be captured in a
CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


@triton.jit
def _grouped_gemm_kernel(a, w, bias, out, pair_ids, tile_expert, route_w, num_experts, n_out, k_in,
                         top_k, s_at, s_ak, s_we, s_wn, s_wk, s_be, s_ot, s_on,
                         GATHER_TOKENS: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_ROUTE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile, n_tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_expert + tile).to(tl.int64)
    if expert >= num_experts:  # tiles past the last expert's: nothing to do
        return
    pairs = tl.load(pair_ids + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    ok = pairs >= 0
    pairs = tl.where(ok, pairs, 0).to(tl.int64)
    if GATHER_TOKENS:  # A's row: the pair's token, or the pair itself
        rows = pairs // top_k
    else:
        rows = pairs
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_in
        x = tl.load(a + rows[:, None] * s_at + k[None, :] * s_ak, mask=ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w + expert * s_we + n[None, :] * s_wn + k[:, None] * s_wk,
                     mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(x.to(wt.dtype), wt, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias + expert * s_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if MUL_ROUTE:
        acc *= tl.load(route_w + pairs, mask=ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out + pairs[:, None] * s_ot + n[None, :] * s_on, acc.to(out.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


def tile_layout(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_ids [tiles * BLOCK_M], tile_expert [tiles]) for ids [T, K], built on the device.

    tiles = ceil(T*K / BLOCK_M) + num_experts bounds the tile count whatever the routing, so the
    shapes depend on T only. Unused slots hold -1; unused tiles name expert num_experts."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    max_tiles = -(-pairs // BLOCK_M) + num_experts
    order = flat.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    tiles_per_expert = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tiles_per_expert.cumsum(0)  # exclusive end tile of each expert
    tile_start = tile_end - tiles_per_expert
    pair_start = counts.cumsum(0) - counts
    sorted_expert = flat[order].long()
    rank = torch.arange(pairs, device=ids.device) - pair_start[sorted_expert]
    slot = tile_start[sorted_expert] * BLOCK_M + rank
    pair_ids = torch.full((max_tiles * BLOCK_M,), -1, dtype=torch.int64, device=ids.device)
    pair_ids.scatter_(0, slot, order)
    tile_expert = torch.searchsorted(tile_end, torch.arange(max_tiles, device=ids.device), right=True)
    return pair_ids, tile_expert


def _gemm(a, w, bias, pair_ids, tile_expert, route_w, out_rows, top_k, gather_tokens):
    num_experts, n_out, k_in = w.shape
    out = torch.empty(out_rows, n_out, dtype=a.dtype, device=a.device)
    block_n = min(64, max(16, triton.next_power_of_2(n_out)))
    block_k = min(64, max(16, triton.next_power_of_2(k_in)))
    grid = (tile_expert.numel(), triton.cdiv(n_out, block_n))
    _grouped_gemm_kernel[grid](
        a, w, bias if bias is not None else w, out, pair_ids, tile_expert,
        route_w if route_w is not None else a, num_experts, n_out, k_in, top_k,
        *a.stride(), *w.stride(), bias.stride(0) if bias is not None else 0, *out.stride(),
        GATHER_TOKENS=gather_tokens, HAS_BIAS=bias is not None, MUL_ROUTE=route_w is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, activation, gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H]; ids, weights [T, K]; gate_up [E, 2I, H]; down [E, H, I] -> [T, H]."""
    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    pair_ids, tile_expert = tile_layout(ids, gate_up.shape[0])
    h = _gemm(x, gate_up, gate_up_bias, pair_ids, tile_expert, None, tokens * top_k, top_k, True)
    h = activation(h)
    route_w = weights.reshape(-1).to(torch.float32).contiguous()
    y = _gemm(h, down, down_bias, pair_ids, tile_expert, route_w, tokens * top_k, top_k, False)
    return y.view(tokens, top_k, -1).sum(dim=1)
