"""CPU path with a compiled paged-decode kernel.

Decode attention in plain torch must first gather every sequence's blocks into a padded
contiguous tensor, which copies the whole KV context each step and dominates decode time on
CPU. This kernel reads K and V straight through the block table, once, in parallel over
(sequence, KV head). store_kv and prefill_attention are the plain torch ones.
"""
from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import njit, prange

from pdserve.kernels.torch_ops import prefill_attention, store_kv  # noqa: F401  (same contract)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    usable = (q.dtype == torch.float32 and q.device.type == "cpu" and k_cache.stride(-1) == 1
              and v_cache.stride() == k_cache.stride())
    if not usable:
        from pdserve.kernels import torch_ops
        return torch_ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    out = torch.empty_like(q)
    # Address K/V through the flat storage: a 1-D contiguous array lets the compiler vectorise
    # the head_dim loop, which a strided per-layer view would not.
    k_flat, v_flat = _flat(k_cache), _flat(v_cache)
    strides = np.array(k_cache.stride()[:3], dtype=np.int64)
    _decode_kernel(q.contiguous().numpy(), k_flat, k_cache.storage_offset(), v_flat,
                   v_cache.storage_offset(), strides, k_cache.shape[1], k_cache.shape[2],
                   block_tables.numpy(), context_lens.numpy(), np.float32(scale), out.numpy())
    return out


def _flat(cache: torch.Tensor) -> np.ndarray:
    return torch.empty(0, dtype=cache.dtype).set_(cache.untyped_storage()).numpy()


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _decode_kernel(q, k_flat, k_offset, v_flat, v_offset, strides, block_size, kv_heads,
                   block_tables, context_lens, scale, out):  # pragma: no cover
    batch, heads, head_dim = q.shape
    group = heads // kv_heads
    for work in prange(batch * kv_heads):
        b, kh = work // kv_heads, work % kv_heads
        length = context_lens[b]
        qs = q[b, kh * group:(kh + 1) * group, :].copy() * scale
        scores = np.empty((group, length), dtype=np.float32)
        for t0 in range(0, length, block_size):
            base = block_tables[b, t0 // block_size] * strides[0] + kh * strides[2]
            for t in range(t0, min(t0 + block_size, length)):
                row = k_offset + base + (t - t0) * strides[1]
                key = k_flat[row:row + head_dim]  # 1-D contiguous views let LLVM vectorise
                for g in range(group):
                    qg = qs[g]
                    acc = np.float32(0.0)
                    for d in range(head_dim):
                        acc += qg[d] * key[d]
                    scores[g, t] = acc
        for g in range(group):
            peak = scores[g].max()
            total = np.float32(0.0)
            for t in range(length):
                e = math.exp(scores[g, t] - peak)
                scores[g, t] = e
                total += e
            scores[g] /= total
        acc_v = np.zeros((group, head_dim), dtype=np.float32)
        for t0 in range(0, length, block_size):
            base = block_tables[b, t0 // block_size] * strides[0] + kh * strides[2]
            for t in range(t0, min(t0 + block_size, length)):
                row = v_offset + base + (t - t0) * strides[1]
                value = v_flat[row:row + head_dim]
                for g in range(group):
                    w = scores[g, t]
                    acc_g = acc_v[g]
                    for d in range(head_dim):
                        acc_g[d] += w * value[d]
        out[b, kh * group:(kh + 1) * group, :] = acc_v


def warm_up() -> None:
    """Compile once at engine start rather than inside the first request."""
    q = torch.zeros(1, 2, 8)
    cache = torch.zeros(2, 4, 1, 8)
    paged_decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                           torch.ones(1, dtype=torch.int32), 1.0)


numba.config.THREADING_LAYER = "workqueue"  # no OpenMP/TBB runtime needed
