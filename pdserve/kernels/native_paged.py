"""Paged decode attention through the compiled step's kernel (native_paged.c), for the decode
rows the Python layers run: a mixed step's (decode rows beside a prefill chunk) and any step the
compiled step does not take.

Over a bf16 cache (--kv-cache-dtype bfloat16) the kernel reads the blocks as they are, where
fp8_kv's wrapper gathered every block the rows read and widened it to float32, each layer. Over a
float32 cache it is the same arithmetic as the compiled step's, so a request's decode rows give
the same values whether their step was mixed or not. None where it does not apply (no compiled
library, queries other than float32 on CPU, a cache other than float32 or bf16, strided rows):
the caller falls back to its own kernel.
"""
from __future__ import annotations

import torch

from pdserve.kernels import native_gemv

_CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _kernel():
    """The kernel (typed in native_gemv.library()) of the library as it is now: not kept here, so
    that switching the library off and on (native_gemv.library.cache_clear()) reaches it."""
    lib = native_gemv.library()
    return None if lib is None else lib.pd_paged_attention


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """numba_ops.paged_decode_attention's contract (q [B, heads, head_dim]; one layer's caches
    [blocks, block_size, kv_heads, head_dim]); None where the compiled kernel does not take it."""
    kernel = _kernel() if _takes(q, k_cache, v_cache) else None
    if kernel is None:
        return None
    tokens, heads, head_dim = q.shape
    out = torch.empty((tokens, heads, head_dim), dtype=torch.float32)
    if tokens == 0:
        return out
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    sink_values = sinks.detach().float().contiguous() if sinks is not None else None
    s_block, s_slot, s_head = k_cache.stride()[:3]
    rc = kernel(q.data_ptr(), q.stride(0), tokens, heads, k_cache.shape[2], head_dim, k_cache.shape[1],
                s_block, s_slot, s_head, scale, k_cache.data_ptr(), v_cache.data_ptr(),
                _CACHE_DTYPES[k_cache.dtype], window, sink_values.data_ptr() if sink_values is not None else None,
                tables.data_ptr(), tables.shape[1], lens.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out if rc == 0 else None


def _takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """float32 queries with each row's heads contiguous (rows may be strided: views of the step's
    qkv), K and V planes of one dtype at the same strides, on CPU."""
    return (q.device.type == k_cache.device.type == "cpu" and q.dtype == torch.float32 and q.dim() == 3
            and q.stride(2) == 1 and q.stride(1) == q.shape[2] and k_cache.dtype in _CACHE_DTYPES
            and v_cache.dtype == k_cache.dtype and k_cache.dim() == 4 and k_cache.stride(-1) == 1
            and v_cache.stride() == k_cache.stride() and q.shape[1] % k_cache.shape[2] == 0)
