"""CPU path with a compiled paged-decode kernel.

Decode attention in plain torch must first gather every sequence's blocks into a padded
contiguous tensor, which copies the whole KV context each step and dominates decode time on
CPU. This kernel reads K and V straight through the block table, once, in parallel over
(sequence, KV head). store_kv is one compiled call too (the torch one is about eight small ops,
per layer and step); prefill_attention is native_prefill's (fresh prompts compiled, the rest torch's).
Where the compiled library is built, decode attention goes through the compiled step's kernel
(native_paged) and this one stays the fallback.
"""
from __future__ import annotations

import math
import weakref

import numpy as np
import torch
from numba import njit, prange

from pdserve.kernels import native_paged, numba_threads, torch_ops  # noqa: F401  (numba_threads: before the first parallel call)
from pdserve.kernels.native_prefill import PREFILL_KEY_ENDS, prefill_attention  # noqa: F401  (same contract)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, kv_heads, head_dim] into the cache slots named by slot_mapping [T]
    (slots < 0 are skipped), as torch_ops.store_kv."""
    usable = (key.dtype == value.dtype == k_cache.dtype and k_cache.dtype in _STORABLE
              and k_cache.device.type == "cpu" and k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride())
    if not usable:
        torch_ops.store_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    k_flat, k_offset, strides = _views(k_cache)
    v_flat, v_offset, _ = _views(v_cache)
    _store_kernel(_as_numpy(key), _as_numpy(value), k_flat, k_offset, v_flat, v_offset, strides[0], strides[1],
                  strides[2], k_cache.shape[1], slot_mapping.numpy())


# numpy has no bfloat16: a bf16 cache and its rows are copied as the int16 words they are
_STORABLE = (torch.float32, torch.bfloat16)


def _as_numpy(x: torch.Tensor) -> np.ndarray:
    return (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy()


@njit(cache=True, nogil=True)
def _store_kernel(key, value, k_flat, k_offset, v_flat, v_offset, s_block, s_slot, s_head, block_size,
                  slots):  # pragma: no cover
    tokens, heads, head_dim = key.shape
    for t in range(tokens):
        slot = slots[t]
        if slot < 0:
            continue
        base = (slot // block_size) * s_block + (slot % block_size) * s_slot
        for h in range(heads):
            k_row = k_offset + base + h * s_head
            v_row = v_offset + base + h * s_head
            for d in range(head_dim):
                k_flat[k_row + d] = key[t, h, d]
                v_flat[v_row + d] = value[t, h, d]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """window > 0: only the last `window` tokens are seen; sinks [heads]: attention sinks (see
    torch_ops). The compiled step's kernel where it takes the rows (native_paged), else numba's."""
    out = native_paged.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window, sinks)
    if out is not None:
        return out
    return numba_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window, sinks)


def numba_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """paged_decode_attention through numba's kernel (float32 queries and cache on CPU; else torch's)."""
    usable = (q.dtype == torch.float32 and q.device.type == "cpu" and k_cache.stride(-1) == 1
              and v_cache.stride() == k_cache.stride())
    if not usable:
        return torch_ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                window, sinks)
    out = torch.empty_like(q)
    # Address K/V through the flat storage: a 1-D contiguous array lets the compiler vectorise
    # the head_dim loop, which a strided per-layer view would not.
    (k_flat, k_offset, strides), (v_flat, v_offset, _) = _views(k_cache), _views(v_cache)
    sink_values = (sinks.detach().float().contiguous().numpy() if sinks is not None
                   else np.zeros(q.shape[1], dtype=np.float32))
    _decode_kernel(q.contiguous().numpy(), k_flat, k_offset, v_flat, v_offset, strides, k_cache.shape[1],
                   k_cache.shape[2],
                   block_tables.numpy(), context_lens.numpy(), np.float32(scale), np.int64(window),
                   sink_values, sinks is not None, out.numpy())
    return out


def _flat(cache: torch.Tensor) -> np.ndarray:
    dtype = torch.int16 if cache.dtype == torch.bfloat16 else cache.dtype
    return torch.empty(0, dtype=dtype).set_(cache.untyped_storage()).numpy()


_VIEWS: dict[int, tuple[weakref.ref, tuple[np.ndarray, int, np.ndarray]]] = {}


def _views(cache: torch.Tensor) -> tuple[np.ndarray, int, np.ndarray]:
    """(the flat storage, the offset, the first three strides) of a layer's cache, made once per
    cache tensor: every layer of every step passes the same ones, and making them cost about 10 us
    a call. An entry goes when its tensor does (the flat view would keep the storage alive)."""
    entry = _VIEWS.get(id(cache))
    if entry is None or entry[0]() is not cache:
        views = (_flat(cache), cache.storage_offset(), np.array(cache.stride()[:3], dtype=np.int64))
        entry = _VIEWS[id(cache)] = (weakref.ref(cache), views)
        weakref.finalize(cache, _VIEWS.pop, id(cache), None)
    return entry[1]


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _decode_kernel(q, k_flat, k_offset, v_flat, v_offset, strides, block_size, kv_heads,
                   block_tables, context_lens, scale, window, sinks, use_sinks, out):  # pragma: no cover
    batch, heads, head_dim = q.shape
    group = heads // kv_heads
    # One (sequence, KV head) per work item, with the query heads that share it: a decode step at
    # one request still has a work item per KV head for each thread (parallel over sequences
    # alone, it ran on one thread). Each token's K (and V) row of a head is one contiguous run.
    for item in prange(batch * kv_heads):
        b, kh = item // kv_heads, item % kv_heads
        end = context_lens[b]
        first = max(0, end - window) if window > 0 else 0  # a sliding window's first visible key
        length = end - first
        qs = q[b, kh * group:(kh + 1) * group].copy() * scale
        scores = np.empty((group, length), dtype=np.float32)
        for i in range(length):
            t = first + i
            row = (k_offset + block_tables[b, t // block_size] * strides[0] + (t % block_size) * strides[1]
                   + kh * strides[2])
            key = k_flat[row:row + head_dim]
            for g in range(group):
                qh = qs[g]
                acc = np.float32(0.0)
                for d in range(head_dim):
                    acc += qh[d] * key[d]
                scores[g, i] = acc
        for g in range(group):
            h = kh * group + g
            peak = scores[g].max()
            if use_sinks:
                peak = max(peak, sinks[h])
            total = np.float32(0.0)
            for i in range(length):
                e = math.exp(scores[g, i] - peak)
                scores[g, i] = e
                total += e
            if use_sinks:  # the sink's share of the softmax goes to no value
                total += math.exp(sinks[h] - peak)
            scores[g] /= total
        acc_v = np.zeros((group, head_dim), dtype=np.float32)
        for i in range(length):
            t = first + i
            row = (v_offset + block_tables[b, t // block_size] * strides[0] + (t % block_size) * strides[1]
                   + kh * strides[2])
            value = v_flat[row:row + head_dim]
            for g in range(group):
                w = scores[g, i]
                acc_g = acc_v[g]
                for d in range(head_dim):
                    acc_g[d] += w * value[d]
        out[b, kh * group:(kh + 1) * group] = acc_v


def warm_up() -> None:
    """Compile once at engine start rather than inside the first request."""
    q = torch.zeros(1, 2, 8)
    cache = torch.zeros(2, 4, 1, 8)
    numba_decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                           torch.ones(1, dtype=torch.int32), 1.0)  # the fallback: compiled (or cached) now
