"""Prefill attention on CPU: fresh prompts in one compiled call (native_prefill.c), the rest in torch.

A prefill step's sequences that have no cached prefix (every key is a new token), no sliding
window shorter than the prompt, no attention sinks and no per-query key ends (image tokens) are
plain causal attention over their own K and V: native_prefill.c runs all of them in one parallel
region, each KV head's query group reading its keys once. torch's CPU flash attention, called
per sequence, took a fifth of a bf16 prefill of SmolLM2 there. Every other sequence (a cached
prefix, a chunk after the first, windows, sinks, images) goes through torch_ops as before. Where
the compiled library is missing (no compiler, neither AVX-512 nor AVX2) everything does.
"""
from __future__ import annotations

import torch

from pdserve.kernels import native_gemv, torch_ops
from pdserve.kernels.torch_ops import PREFILL_KEY_ENDS  # noqa: F401  (same contract as torch_ops)

HEAD_DIM_STEP = 64  # the kernel's output tile: head_dim must be a multiple


def _kernel():
    """The kernel (typed in native_gemv.library()) of the library as it is now (see native_paged)."""
    lib = native_gemv.library()
    return None if lib is None else lib.pd_prefill_attention


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, window: int = 0, sinks: torch.Tensor | None = None,
                      key_ends: torch.Tensor | None = None) -> torch.Tensor:
    """torch_ops.prefill_attention's contract; fresh prompts through the compiled kernel."""
    kernel = _kernel() if _compiled_shape(q, k_new, v_new, sinks, key_ends) else None
    if kernel is None:
        return torch_ops.prefill_attention(q, k_new, v_new, k_cache, v_cache, cu_seqlens_q, context_lens,
                                           block_tables, scale, window, sinks, key_ends)
    cu, contexts = cu_seqlens_q.tolist(), context_lens.tolist()
    fresh = [i for i, ctx in enumerate(contexts)
             if ctx == cu[i + 1] - cu[i] > 0 and (not window or window >= ctx)]
    out = torch.empty(q.shape, dtype=q.dtype)
    if fresh:
        starts = torch.tensor([cu[i] for i in fresh], dtype=torch.int32)
        lens = torch.tensor([contexts[i] for i in fresh], dtype=torch.int32)
        heads, head_dim = q.shape[1], q.shape[2]
        rc = kernel(q.data_ptr(), q.stride(0), k_new.data_ptr(), k_new.stride(0), v_new.data_ptr(), v_new.stride(0),
                    starts.data_ptr(), lens.data_ptr(), len(fresh), heads, k_new.shape[1], head_dim, scale,
                    out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            fresh = []
    if len(fresh) < len(contexts):
        torch_ops.attend_each(q, k_new, v_new, k_cache, v_cache, cu, contexts, block_tables, scale, window,
                              sinks, key_ends, out, skip=set(fresh))
    return out


def _compiled_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                    key_ends: torch.Tensor | None) -> bool:
    """Whether the kernel takes these tensors: float32 on CPU, each token's [heads, head_dim]
    contiguous (tokens may be strided: views of the step's qkv), head_dim a multiple of 64."""
    return (sinks is None and key_ends is None and q.device.type == "cpu"
            and q.dtype == k.dtype == v.dtype == torch.float32 and q.shape[2] % HEAD_DIM_STEP == 0
            and q.shape[1] % k.shape[1] == 0 and all(_rows_dense(t) for t in (q, k, v)))


def _rows_dense(t: torch.Tensor) -> bool:
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]
