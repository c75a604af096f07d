"""CPU matmul over FP8 (e4m3) weights with per-row, per-column-block scales:
w[n, k] = e4m3(q[n, k]) * scale[n, k // block], q the weight's bytes (uint8).

Per-channel and per-tensor weights are block = all columns (one scale per row); 128x128 block
checkpoints have their block scales repeated down the rows of each block at load, so a fused
layer whose parts' rows are not multiples of 128 needs nothing special.

The activations come in already quantized and dequantized (x_dq = e4m3(x / s) * s, per token or
per token and column group, pdserve.layers.quant.act_quant), so each product is x_dq * w_dq in
float32: the values a plain-torch reference multiplies, only summed in another order.

Two paths, as pdserve.kernels.quant_cpu: up to GEMV_MAX_TOKENS tokens each row is decoded once
(through a 256-entry table) into a buffer that stays in L1 and dotted with every token; more,
tiles of rows are decoded into one reused float32 buffer and multiplied by BLAS.
torch._scaled_mm runs on CPU in torch 2.13 but was 20 to 140 times slower than these on
SmolLM2's shapes (benchmarks/kernels/bench_act_quant_matmul.py).
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from pdserve.kernels import numba_threads  # noqa: F401  (before the first parallel call)
from pdserve.kernels.dequant_tiles import matmul_by_tiles

GEMV_MAX_TOKENS = 16
ROWS_PER_TASK = 16
E4M3_TO_FLOAT = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


@njit(cache=True, nogil=True, inline="always")
def _decode_row(q, scales, block, table, n, w):  # pragma: no cover
    """Row n, dequantized into w. An e4m3 byte's sign, exponent and mantissa moved into a float32's
    (sign to bit 31, the other seven bits to bits 20..26) give its value times 2^-120, subnormals
    included; the 2^120 goes into the scale (exactly: a power of two), so each weight is one
    float32 product, as the table's value times the scale is, with no table lookup (the loop
    vectorises)."""
    qrow = q[n]
    bits = w.view(np.uint32)
    for k in range(w.shape[0]):
        b = np.uint32(qrow[k])
        bits[k] = ((b & np.uint32(0x80)) << np.uint32(24)) | ((b & np.uint32(0x7F)) << np.uint32(20))
    for b in range(scales.shape[1]):
        sc = scales[n, b] * np.float32(2.0 ** 120)
        for k in range(b * block, min(w.shape[0], (b + 1) * block)):
            w[k] = w[k] * sc


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _gemv(x, q, scales, block, table, out):  # pragma: no cover
    tokens, cols = x.shape
    rows = q.shape[0]
    tasks = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(tasks):
        w = np.empty(cols, dtype=np.float32)
        for n in range(task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK)):
            _decode_row(q, scales, block, table, n, w)
            for t in range(tokens):
                xt = x[t]
                s = np.float32(0.0)
                for k in range(cols):
                    s += w[k] * xt[k]
                out[t, n] = s


@njit(parallel=True, cache=True, nogil=True)
def _dequantize(q, scales, block, table, start, out):  # pragma: no cover
    # No fastmath: q * scale must round as the float32 reference's dequantization does.
    for i in prange(out.shape[0]):
        _decode_row(q, scales, block, table, start + i, out[i])


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """The whole float32 matrix (for layers that need it dequantized, and for tests)."""
    out = np.empty(tuple(q.shape), dtype=np.float32)
    _dequantize(q.numpy(), scales.numpy(), block, E4M3_TO_FLOAT, 0, out)
    return torch.from_numpy(out)


def fp8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """x [tokens, K] float32 @ w.T -> [tokens, N]; q uint8 [N, K], scales float32 [N, ceil(K / block)]."""
    x = x.float().contiguous()
    qn, sn = q.numpy(), scales.numpy()
    tokens, rows = x.shape[0], q.shape[0]
    if tokens <= GEMV_MAX_TOKENS:
        out = np.empty((tokens, rows), dtype=np.float32)
        _gemv(x.numpy(), qn, sn, block, E4M3_TO_FLOAT, out)
        return torch.from_numpy(out)
    return matmul_by_tiles(x, rows, lambda start, _, tile: _dequantize(qn, sn, block, E4M3_TO_FLOAT, start, tile),
                           ROWS_PER_TASK)
