"""Fused elementwise ops for the Llama layers on CPU, the twins of triton_fused: residual add +
RMSNorm and rotary embedding in place on the q/k views of the fused qkv output (compiled), and
SiLU(gate) * up (torch's, which was faster).

Why: at one request a CPU decode step ran the norms and RoPE as about 20 small torch ops per
layer, each a few microseconds of dispatch for 576 numbers (SmolLM2-135M has 30 layers). Each is
one compiled call here, with no parallel region (a decode step's rows are few).

They compute what the torch modules of pdserve.models.llama compute, op for op in float32 (no
fused multiply-adds; only the RMSNorm's sum of squares is reordered). Other dtypes go through
those torch ops unchanged.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit

from pdserve.kernels import dequant_tiles, native_gemv


@njit(cache=True, nogil=True, fastmath={"reassoc", "nsz"})
def _rms_norm(x, delta, has_delta, w, eps, summed, out):  # pragma: no cover
    rows, cols = x.shape
    for r in range(rows):
        src = x[r]
        if has_delta:
            for c in range(cols):
                summed[r, c] = x[r, c] + delta[r, c]
            src = summed[r]
        ss = np.float32(0.0)
        for c in range(cols):
            ss += src[c] * src[c]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(cols) + eps)
        for c in range(cols):
            out[r, c] = w[c] * (src[c] * inv)


@njit(cache=True, nogil=True)
def _rope(x, cos, sin):  # pragma: no cover
    tokens, heads, dim = x.shape
    half = dim // 2
    for t in range(tokens):
        for h in range(heads):
            for d in range(half):
                x1, x2 = x[t, h, d], x[t, h, d + half]
                x[t, h, d] = x1 * cos[t, d] - x2 * sin[t, d]
                x[t, h, d + half] = x2 * cos[t, d + half] + x1 * sin[t, d + half]


def _fits(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)) for x, delta [T, hidden]; without delta, (x, RMSNorm(x))."""
    if not _fits(x, weight, *(() if delta is None else (delta,))):
        summed = x if delta is None else x + delta
        x32 = summed.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return summed, weight * normed.to(summed.dtype)
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if delta is not None else x
    lib = _rows_library(x, weight, *(() if delta is None else (delta,)))
    if lib is not None:
        lib.pd_norm_rows(x.data_ptr(), None if delta is None else delta.data_ptr(), None, summed.data_ptr(),
                         weight.data_ptr(), eps, x.shape[0], x.shape[1], out.data_ptr(), None, torch.get_num_threads())
        return summed, out
    _rms_norm(x.numpy(), (delta if delta is not None else x).numpy(), delta is not None,
              weight.detach().numpy(), np.float32(eps), summed.numpy(), out.numpy())
    return summed, out


def takes_low(x: torch.Tensor) -> bool:
    """Whether rms_norm_low takes these rows: the many-row ops' (native_rows.c) under bf16
    products, AVX-512 BF16 for the rounding, rows of a multiple of 32 floats."""
    return (x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] % 32 == 0 and dequant_tiles.avx512_bf16()
            and _rows_library(x) is not None)


def rms_norm_low(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm's (x + delta, RMSNorm(x + delta)) with the normed rows rounded to bf16 (the bf16
    products' own rounding of their float32 input: the same words) for rows takes_low takes;
    delta float32 or bf16 (a bf16 product's result: widened exactly)."""
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    summed = torch.empty_like(x) if delta is not None else x
    bf16_delta = delta is not None and delta.dtype == torch.bfloat16
    if delta is not None and not (delta.is_contiguous() and delta.shape == x.shape):
        raise ValueError("rms_norm_low: delta must be contiguous and shaped as x")
    rc = native_gemv.library().pd_norm_rows(
        x.data_ptr(), None if delta is None or bf16_delta else delta.data_ptr(), delta.data_ptr() if bf16_delta else None,
        summed.data_ptr(), weight.data_ptr(), eps, x.shape[0], x.shape[1], None, out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("rms_norm_low on rows takes_low does not take")
    return summed, out


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding in place: q [T, H, D], k [T, Hk, D] (strided views allowed, unit stride
    in D); cos, sin [T, 1, D] in q's dtype (RotaryEmbedding.cos_sin)."""
    if not _fits(q, k, cos, sin):
        for x in (q, k):
            half = x.shape[-1] // 2
            x.copy_(x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)
        return
    tokens, dim = q.shape[0], q.shape[-1]
    c, s = cos.reshape(tokens, dim), sin.reshape(tokens, dim)
    lib = _rows_library(q, k, c, s) if q.stride(1) == k.stride(1) == dim else None
    if lib is not None and c.is_contiguous() and s.is_contiguous():
        lib.pd_rope_rows(q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1], dim,
                         c.data_ptr(), s.data_ptr(), tokens, torch.get_num_threads())
        return
    _rope(q.numpy(), c.numpy(), s.numpy())
    _rope(k.numpy(), c.numpy(), s.numpy())


def widen_rope(qkv: torch.Tensor, q_heads: int, k_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """qkv [T, (q_heads + 2 k_heads) D] bf16 (a bf16 product's rows) widened to float32 with q's and
    k's heads rotated (rope_'s values) in one compiled pass; None where it does not take these rows
    (the caller widens them and runs rope_)."""
    tokens, width = qkv.shape
    dim = width // (q_heads + 2 * k_heads)
    c, s = cos.reshape(tokens, dim), sin.reshape(tokens, dim)
    lib = _rows_library(qkv, c, s)
    if lib is None or qkv.dtype != torch.bfloat16 or c.dtype != torch.float32 or not c.is_contiguous() \
            or not s.is_contiguous():
        return None
    out = torch.empty(tokens, width)
    lib.pd_widen_rope_rows(qkv.data_ptr(), tokens, q_heads, k_heads, dim, c.data_ptr(), s.data_ptr(), out.data_ptr(),
                           torch.get_num_threads())
    return out


# Past this many rows, under bf16 products, the norms and RoPE run on every thread of torch's pool
# (native_rows.c; their sums in another order than the kernels above, so not under float32, whose
# values stay these kernels'): on one thread a 2,048-token prefill's two norms and RoPE took about
# 4 ms a layer while torch's second thread waited. From 32 rows, not 256, so that a short prompt's
# step also keeps bf16 rows between its norms and products (layers/bf16_rows.py): one 160-token
# prompt's prefill step 105-113 -> 93-94 ms, a 64-token one 79 -> 72 ms (the 2-core AMX Xeon,
# alternated, medians of 7-12).
PARALLEL_ROWS = 32


def _rows_library(x: torch.Tensor, *others: torch.Tensor):
    """The compiled library where the many-row ops take these tensors (contiguous rows), else None."""
    if x.shape[0] < PARALLEL_ROWS or dequant_tiles.tile_dtype() != torch.bfloat16:
        return None
    if not all(t.stride(-1) == 1 and (t.dim() != 2 or t.stride(0) == t.shape[1]) for t in (x, *others)):
        return None
    return native_gemv.library()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [T, 2 * I] (gate first): [T, I]. torch's own ops: its
    vectorised exp beat a compiled loop (5.5 against 8.6 us at one token, 11 against 39 at
    eight; benchmarks/kernels/bench_cpu_layer_ops.py); past PARALLEL_ROWS under low-precision
    products, one compiled pass on every thread (native_rows.c), as the norms."""
    lib = _rows_library(gate_up) if gate_up.dim() == 2 and gate_up.dtype == torch.float32 else None
    if lib is not None:
        act = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2)
        lib.pd_silu_mul_rows(gate_up.data_ptr(), gate_up.shape[0], act.shape[1], act.data_ptr(),
                             torch.get_num_threads())
        return act
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
