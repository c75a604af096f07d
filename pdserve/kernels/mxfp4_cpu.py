"""CPU matmul over MXFP4 weights (gpt-oss's experts): w[n, k] = fp4(q[n, k]) * 2^(e[n, k // 32] - 127),
q the 4-bit e2m1 codes two per byte (the low nibble first, as gpt-oss stores them), e one biased
power of two per 32 columns (uint8). Every weight is exact in float32, so the products are those
of transformers' dequantized float32 weights; only the order of the sums differs.

Same two paths as pdserve.kernels.fp8_cpu: up to GEMV_MAX_TOKENS tokens each row is decoded once
into an L1 buffer and dotted with every token; above, tiles of rows are decoded into one reused
buffer and multiplied by BLAS.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from pdserve.kernels import numba_threads  # noqa: F401  (before the first parallel call)
from pdserve.kernels.dequant_tiles import matmul_by_tiles

GEMV_MAX_TOKENS = 16
ROWS_PER_TASK = 16
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
# 2^(e - 127), exact in float32 (2^-127 a subnormal); e = 255 is E8M0's NaN.
POW2 = np.append(np.ldexp(1.0, np.arange(255) - 127), np.nan).astype(np.float32)


@njit(cache=True, nogil=True, inline="always")
def _decode_row(q, scales, lut, pow2, n, w):  # pragma: no cover
    qrow, srow = q[n], scales[n]
    for g in range(srow.shape[0]):
        sc = pow2[srow[g]]
        for j in range(16):
            b = qrow[g * 16 + j]
            w[g * 32 + 2 * j] = lut[b & np.uint8(15)] * sc
            w[g * 32 + 2 * j + 1] = lut[b >> np.uint8(4)] * sc


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _gemv(x, q, scales, lut, pow2, out):  # pragma: no cover
    tokens, cols = x.shape
    rows = q.shape[0]
    for task in prange((rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        w = np.empty(cols, dtype=np.float32)
        for n in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
            _decode_row(q, scales, lut, pow2, n, w)
            for t in range(tokens):
                xt = x[t]
                s = np.float32(0.0)
                for k in range(cols):
                    s += w[k] * xt[k]
                out[t, n] = s


@njit(parallel=True, cache=True, nogil=True)
def _dequantize(q, scales, lut, pow2, start, out):  # pragma: no cover
    for i in prange(out.shape[0]):
        _decode_row(q, scales, lut, pow2, start + i, out[i])


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K / 2], scales uint8 [N, K / 32] -> float32 [N, K]."""
    out = np.empty((q.shape[0], q.shape[1] * 2), dtype=np.float32)
    _dequantize(q.numpy(), scales.numpy(), FP4_VALUES, POW2, 0, out)
    return torch.from_numpy(out)


def mxfp4_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [tokens, K] float32 @ w.T -> [tokens, N]."""
    x = x.float().contiguous()
    qn, sn = q.numpy(), scales.numpy()
    tokens, rows = x.shape[0], q.shape[0]
    if tokens <= GEMV_MAX_TOKENS:
        out = np.empty((tokens, rows), dtype=np.float32)
        _gemv(x.numpy(), qn, sn, FP4_VALUES, POW2, out)
        return torch.from_numpy(out)
    return matmul_by_tiles(x, rows, lambda start, _, tile: _dequantize(qn, sn, FP4_VALUES, POW2, start, tile),
                           ROWS_PER_TASK)
