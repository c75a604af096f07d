"""Absorbed MLA decode over the paged latent cache as a Triton kernel: the GPU path (CPU under
TRITON_INTERPRET=1). Same contract as pdserve.kernels.mla_ops.paged_latent_decode.

A program owns one sequence, a tile of 16 query heads and one split of the context: the heads
of a tile share every latent load (one latent "KV head"), which is what makes the absorbed form
cheap to read, and the splits (flash-decoding) give a small batch enough programs to fill the
GPU; their partial results are merged in torch. Each key tile is split into its compressed part
(the first value_dim entries, also the values) and its rotary part, so neither needs padding to
the next power of two together. Softmax is the online (flash) form, accumulated in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_ops import _dot_dtype

_LOG2E = 1.4426950408889634
# 16-bit launch: 64 heads x 64 keys per program, 8 warps, 2 stages, about 512 programs: the
# best of a 72-launch sweep on an H100 (bf16, 128 heads, a 512 + 64 latent; docs/models.md has
# the table). fp32 keeps 16 x 16 tiles: its accumulator would not fit in registers.
_LAUNCH_16BIT = {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}


@triton.jit
def _latent_decode_kernel(
        q, cache, acc_out, ml_out, block_tables, context_lens, qk_scale, heads, value_dim, rope_dim,
        block_size, split_len, s_qb, s_qh, s_qd, s_cb, s_co, s_cd, s_ab, s_as, s_ah, s_mb, s_ms, s_mh,
        s_bt, s_bc, DOT_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    """One (sequence, head tile, context split): the split's unnormalised output and its
    running max and sum, merged across splits afterwards (flash-decoding)."""
    seq, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(context_lens + seq)
    first, last = split * split_len, tl.minimum(split * split_len + split_len, ctx)
    h = tile * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < heads
    c = tl.arange(0, BLOCK_C)
    r = tl.arange(0, BLOCK_R)
    c_ok, r_ok = c < value_dim, r < rope_dim
    q_row = q + seq.to(tl.int64) * s_qb + h[:, None] * s_qh
    q_c = tl.load(q_row + c[None, :] * s_qd, mask=h_ok[:, None] & c_ok[None, :], other=0.0).to(DOT_DTYPE)
    q_r = tl.load(q_row + (value_dim + r[None, :]) * s_qd, mask=h_ok[:, None] & r_ok[None, :],
                  other=0.0).to(DOT_DTYPE)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    table = block_tables + seq.to(tl.int64) * s_bt
    for start in range(first, last, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < last
        blk = tl.load(table + (pos // block_size) * s_bc, mask=pos_ok, other=0).to(tl.int64)
        row = cache + blk[:, None] * s_cb + (pos % block_size)[:, None] * s_co
        k_c = tl.load(row + c[None, :] * s_cd, mask=pos_ok[:, None] & c_ok[None, :], other=0.0).to(DOT_DTYPE)
        k_r = tl.load(row + (value_dim + r[None, :]) * s_cd, mask=pos_ok[:, None] & r_ok[None, :],
                      other=0.0).to(DOT_DTYPE)
        # "ieee" keeps fp32 inputs out of TF32 (matches the torch path); other dtypes ignore it.
        s = (tl.dot(q_c, tl.trans(k_c), input_precision="ieee")
             + tl.dot(q_r, tl.trans(k_r), input_precision="ieee")) * qk_scale
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), k_c, input_precision="ieee")
        m_i = m_new
    base = seq.to(tl.int64) * s_ab + split * s_as + h[:, None] * s_ah
    tl.store(acc_out + base + c[None, :], acc, mask=h_ok[:, None] & c_ok[None, :])
    ml = ml_out + seq.to(tl.int64) * s_mb + split * s_ms + h * s_mh
    tl.store(ml, m_i, mask=h_ok)
    tl.store(ml + 1, l_i, mask=h_ok)


def paged_latent_decode(q: torch.Tensor, cache: torch.Tensor, value_dim: int, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, scale: float, tuning: dict | None = None) -> torch.Tensor:
    """q [B, heads, latent_dim] absorbed queries; cache [num_blocks, block_size, 1, latent_dim]
    (may be a strided view); returns [B, heads, value_dim]. Every context length must be >= 1
    (the query's own token is in the cache). tuning: launch options a benchmark may try
    (BLOCK_H, BLOCK_N, programs, num_warps, num_stages)."""
    tuning = tuning or (_LAUNCH_16BIT if q.dtype in (torch.bfloat16, torch.float16) else {})
    batch, heads, latent_dim = q.shape
    if batch == 0:
        return q.new_empty(batch, heads, value_dim)
    block_c = max(16, triton.next_power_of_2(value_dim))
    block_r = max(16, triton.next_power_of_2(latent_dim - value_dim))
    # tl.dot needs tiles >= 16; more heads per program spill the fp32 accumulator.
    block_h = tuning.get("BLOCK_H", 16)
    block_n = tuning.get("BLOCK_N", 16 if block_c > 256 else 32)  # the latent tile within the register budget
    head_tiles = triton.cdiv(heads, block_h)
    # Split long contexts so there are enough programs to fill the GPU (about 4 per SM).
    max_len = int(context_lens.max())
    wanted_splits = max(1, -(-tuning.get("programs", 512) // (batch * head_tiles)))
    split_len = max(4 * block_n, triton.next_power_of_2(-(-max_len // wanted_splits)))
    splits = -(-max_len // split_len)
    acc = torch.empty(batch, splits, heads, block_c, dtype=torch.float32, device=q.device)
    ml = torch.empty(batch, splits, heads, 2, dtype=torch.float32, device=q.device)
    _latent_decode_kernel[(batch, head_tiles, splits)](
        q, cache, acc, ml, block_tables, context_lens, scale * _LOG2E, heads, value_dim, latent_dim - value_dim,
        cache.shape[1], split_len, *q.stride(), cache.stride(0), cache.stride(1), cache.stride(3),
        acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(1), ml.stride(2),
        *block_tables.stride(), DOT_DTYPE=_dot_dtype(q.dtype), BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_C=block_c, BLOCK_R=block_r, **{k: v for k, v in tuning.items() if k in ("num_warps", "num_stages")})
    return _merge_splits(acc[..., :value_dim], ml[..., 0], ml[..., 1]).to(q.dtype)


def _merge_splits(acc: torch.Tensor, m: torch.Tensor, l_sum: torch.Tensor) -> torch.Tensor:
    """Splits' (unnormalised output, max, sum) in log2 units, [B, S, H, ...] -> [B, H, C]."""
    top = m.max(dim=1, keepdim=True).values
    weight = torch.exp2(m - top)  # an empty split has m = -inf: weight 0
    return (acc * weight[..., None]).sum(1) / (l_sum * weight).sum(1)[..., None]
