"""CPU kernels over group-quantized weights: w[n, k] = q[n, k] * scale[n, k // group] (+ min[n, k // group]).

Two storage widths, one arithmetic:
- int4: q in 0..15, two per byte. Each run of 32 columns is 16 bytes; byte j holds column j in
  its low nibble and column j + 16 in its high nibble (GGUF's Q4_0/Q4_1 block order, so those
  load without reordering).
- int8: q as int8, one per byte.

Scales and mins are float32, or float16 kept as their raw 16 bits (uint16) where the checkpoint
stores float16 (GGUF Q4_0, Q4_1, Q8_0): that halves their bytes. numba has no float16 on CPU, so
the kernels widen them through a 65536-entry table, exactly.

Two ways to multiply, chosen by the number of tokens (see QUANT_GEMV_MAX_TOKENS):
- gemv: a fused dequantize-and-dot that reads each weight byte once for all tokens; decode
  steps are memory-bound, and this reads 4-8 bits per weight instead of 32;
- dequantize the whole matrix to float32, then one BLAS matmul: prefill is compute-bound, and
  the dequantization is amortised over its tokens. The float32 values are the ones transformers
  computes when it dequantizes the same checkpoint (q * scale + min, in float32).
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from pdserve.kernels import numba_threads  # noqa: F401  (before the first parallel call)

# Up to this many tokens the fused gemv kernel beats dequantize + BLAS (measured on the 2-core
# CPU machine for SmolLM2's shapes, benchmarks/bench_quant_matmul.py).
QUANT_GEMV_MAX_TOKENS = 8

HALF_TO_FLOAT = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)


def _scale_value(s, table):  # pragma: no cover  (replaced by the overload in compiled code)
    return s


@overload(_scale_value)
def _scale_value_impl(s, table):
    if isinstance(s, types.Integer):  # float16 bits
        return lambda s, table: table[s]
    return lambda s, table: np.float32(s)


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _gemv4(x, xsum, q, scales, mins, has_min, group, table, out):  # pragma: no cover
    tokens, cols = x.shape
    rows = q.shape[0]
    chunks_per_group = group // 32
    for n in prange(rows):
        acc = np.zeros(tokens, dtype=np.float32)
        part = np.zeros(tokens, dtype=np.float32)
        for g in range(scales.shape[1]):
            part[:] = 0.0
            for c in range(g * chunks_per_group, (g + 1) * chunks_per_group):
                base = c * 32
                qrow = q[n, c * 16:(c + 1) * 16]
                for t in range(tokens):
                    s = np.float32(0.0)
                    for j in range(16):
                        b = qrow[j]
                        s += np.float32(b & 15) * x[t, base + j] + np.float32(b >> 4) * x[t, base + 16 + j]
                    part[t] += s
            sc = _scale_value(scales[n, g], table)
            for t in range(tokens):
                acc[t] += sc * part[t]
            if has_min:
                mn = _scale_value(mins[n, g], table)
                for t in range(tokens):
                    acc[t] += mn * xsum[t, g]
        for t in range(tokens):
            out[t, n] = acc[t]


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _gemv8(x, xsum, q, scales, mins, has_min, group, table, out):  # pragma: no cover
    tokens, cols = x.shape
    rows = q.shape[0]
    for n in prange(rows):
        acc = np.zeros(tokens, dtype=np.float32)
        for g in range(scales.shape[1]):
            sc = _scale_value(scales[n, g], table)
            qrow = q[n, g * group:(g + 1) * group]
            for t in range(tokens):
                s = np.float32(0.0)
                xrow = x[t, g * group:(g + 1) * group]
                for j in range(group):
                    s += np.float32(qrow[j]) * xrow[j]
                acc[t] += sc * s
            if has_min:
                mn = _scale_value(mins[n, g], table)
                for t in range(tokens):
                    acc[t] += mn * xsum[t, g]
        for t in range(tokens):
            out[t, n] = acc[t]


@njit(parallel=True, cache=True, nogil=True)
def _dequant4(q, scales, mins, has_min, group, table, row_ids, out):  # pragma: no cover
    # No fastmath: q * scale + min must round as transformers' float32 dequantization does.
    for i in prange(row_ids.shape[0]):
        n = row_ids[i]
        for c in range(q.shape[1] // 16):
            g = c * 32 // group
            sc = _scale_value(scales[n, g], table)
            mn = _scale_value(mins[n, g], table) if has_min else np.float32(0.0)
            for j in range(16):
                b = q[n, c * 16 + j]
                out[i, c * 32 + j] = np.float32(b & 15) * sc + mn
                out[i, c * 32 + 16 + j] = np.float32(b >> 4) * sc + mn


@njit(parallel=True, cache=True, nogil=True)
def _dequant8(q, scales, mins, has_min, group, table, row_ids, out):  # pragma: no cover
    for i in prange(row_ids.shape[0]):
        n = row_ids[i]
        for k in range(q.shape[1]):
            g = k // group
            sc = _scale_value(scales[n, g], table)
            mn = _scale_value(mins[n, g], table) if has_min else np.float32(0.0)
            out[i, k] = np.float32(q[n, k]) * sc + mn


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _mins_np(mins: torch.Tensor | None, scales: torch.Tensor) -> np.ndarray:
    return _np(mins) if mins is not None else _np(scales[:0])


def dequantize_rows(bits: int, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                    group: int, row_ids: torch.Tensor | None = None) -> torch.Tensor:
    """float32 rows `row_ids` (all rows when None) of the quantized matrix."""
    ids = (np.arange(q.shape[0], dtype=np.int64) if row_ids is None
           else row_ids.reshape(-1).to(torch.int64).numpy())
    cols = q.shape[1] * (2 if bits == 4 else 1)
    out = np.empty((ids.shape[0], cols), dtype=np.float32)
    kernel = _dequant4 if bits == 4 else _dequant8
    kernel(_np(q), _np(scales), _mins_np(mins, scales), mins is not None, group, HALF_TO_FLOAT, ids, out)
    return torch.from_numpy(out)


def quant_matmul(x: torch.Tensor, bits: int, q: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None, group: int) -> torch.Tensor:
    """x [tokens, K] float32 @ w.T -> [tokens, N], w the dequantized [N, K] matrix."""
    tokens = x.shape[0]
    if tokens > QUANT_GEMV_MAX_TOKENS:
        return torch.nn.functional.linear(x, dequantize_rows(bits, q, scales, mins, group))
    x = x.float().contiguous()
    xn = x.numpy()
    groups = scales.shape[1]
    # Per-group sums of x: the min term of every row in a group is min * sum(x over the group).
    xsum = (x.view(tokens, groups, -1).sum(-1).numpy() if mins is not None
            else np.zeros((tokens, groups), dtype=np.float32))
    out = np.empty((tokens, q.shape[0]), dtype=np.float32)
    kernel = _gemv4 if bits == 4 else _gemv8
    kernel(xn, xsum, _np(q), _np(scales), _mins_np(mins, scales), mins is not None, group, HALF_TO_FLOAT, out)
    return torch.from_numpy(out)
