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
- gemv: each row is dequantized once, into a buffer that stays in L1, and dotted with every
  token of the step; decode steps are memory-bound, and this reads 4-8 bits per weight instead of 32.
  Each row's scales are broadcast to its columns first, so that decoding is one flat loop the
  compiler vectorises; an int4 row decodes in value order (all low nibbles, then all high ones)
  and meets the step's tokens with their columns permuted to match;
- dequantize a tile of rows to float32, multiply it by BLAS, next tile: prefill is
  compute-bound, and the dequantization is amortised over its tokens.
Both multiply the float32 values transformers computes when it dequantizes the same checkpoint
(q * scale + min, in float32); only the order of the sums differs.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from pdserve.kernels import numba_threads  # noqa: F401  (before the first parallel call)
from pdserve.kernels.dequant_tiles import matmul_by_tiles

# Up to this many tokens the fused gemv kernel beats dequantize + BLAS (measured on the 2-core
# CPU machine for SmolLM2's shapes, benchmarks/bench_quant_matmul.py).
QUANT_GEMV_MAX_TOKENS = 16
ROWS_PER_TASK = 16
# Dequantize + BLAS works on tiles of about this many float32 bytes, in one reused buffer: the
# tile stays in cache between being written and being read, and the LM head (49152 rows on
# SmolLM2) never exists in float32 whole.

HALF_TO_FLOAT = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)


def _scale_value(s, table):  # pragma: no cover  (replaced by the overload in compiled code)
    return s


@overload(_scale_value)
def _scale_value_impl(s, table):
    if isinstance(s, types.Integer):  # float16 bits
        return lambda s, table: table[s]
    return lambda s, table: np.float32(s)


@njit(cache=True, nogil=True, inline="always")
def _decode_row(q, scales, mins, has_min, group, table, bits, n, w, se, me):  # pragma: no cover
    """Row n, dequantized into w (simple loops the compiler vectorises); se and me are scratch
    rows of cols floats. Inlined into its callers and compiled with their flags: the gemv may fuse
    the multiply-add, _dequantize must not (it gives transformers' float32 values exactly)."""
    qrow = q[n]
    if bits == 8:
        # Every column's scale (and min) first, one broadcast per group, then one flat loop over
        # the row: a loop over 16 columns per scale is unrolled and left scalar by the compiler
        # (3x slower on SmolLM2's Q8_0 LM head).
        for g in range(w.shape[0] // group):
            se[g * group:(g + 1) * group] = _scale_value(scales[n, g], table)
            if has_min:
                me[g * group:(g + 1) * group] = _scale_value(mins[n, g], table)
        if has_min:
            for k in range(w.shape[0]):
                w[k] = np.float32(qrow[k]) * se[k] + me[k]
        else:
            for k in range(w.shape[0]):
                w[k] = np.float32(qrow[k]) * se[k]
        return
    for c in range(w.shape[0] // 32):
        base = c * 32
        # Halves of 16 columns: a group holds 16 columns or a multiple of 32 (Q6_K's are 16).
        for h in range(2):
            g = (base + 16 * h) // group
            sc = _scale_value(scales[n, g], table)
            mn = _scale_value(mins[n, g], table) if has_min else np.float32(0.0)
            start = base + 16 * h
            for j in range(16):
                b = qrow[c * 16 + j]
                w[start + j] = np.float32((b >> np.uint8(4 * h)) & np.uint8(15)) * sc + mn


@njit(cache=True, nogil=True, inline="always")
def _decode_row_int4_value_order(q, scales, mins, has_min, group, table, n, w, se, me):  # pragma: no cover
    """Row n of an int4 matrix dequantized in value order: the low nibbles of its bytes into the
    first half of w, the high nibbles into the second (see _value_order)."""
    qrow = q[n]
    half = w.shape[0] // 2
    if group == 16:  # byte run c holds group 2c in its low nibbles, 2c + 1 in its high ones
        for c in range(half // 16):
            se[c * 16:(c + 1) * 16] = _scale_value(scales[n, 2 * c], table)
            se[half + c * 16:half + (c + 1) * 16] = _scale_value(scales[n, 2 * c + 1], table)
            if has_min:
                me[c * 16:(c + 1) * 16] = _scale_value(mins[n, 2 * c], table)
                me[half + c * 16:half + (c + 1) * 16] = _scale_value(mins[n, 2 * c + 1], table)
    else:  # a group of 32k columns is k byte runs, low and high nibbles alike
        step = group // 2
        for g in range(half // step):
            sc = _scale_value(scales[n, g], table)
            se[g * step:(g + 1) * step] = sc
            se[half + g * step:half + (g + 1) * step] = sc
            if has_min:
                mn = _scale_value(mins[n, g], table)
                me[g * step:(g + 1) * step] = mn
                me[half + g * step:half + (g + 1) * step] = mn
    if not has_min:
        me[:] = 0.0
    for i in range(half):
        w[i] = np.float32(qrow[i] & np.uint8(15)) * se[i] + me[i]
    for i in range(half):
        w[half + i] = np.float32(qrow[i] >> np.uint8(4)) * se[half + i] + me[half + i]


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _gemv(x, q, scales, mins, has_min, group, table, bits, out):  # pragma: no cover
    tokens, cols = x.shape
    rows = q.shape[0]
    blocks = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for blk in prange(blocks):
        w = np.empty(cols, dtype=np.float32)
        se = np.empty(cols, dtype=np.float32)
        me = np.empty(cols, dtype=np.float32)
        for n in range(blk * ROWS_PER_TASK, min(rows, (blk + 1) * ROWS_PER_TASK)):
            # The row is dequantized once (it stays in L1) and dotted with every token of the step.
            if bits == 4:
                _decode_row_int4_value_order(q, scales, mins, has_min, group, table, n, w, se, me)
            else:
                _decode_row(q, scales, mins, has_min, group, table, bits, n, w, se, me)
            for t in range(tokens):
                xt = x[t]
                s = np.float32(0.0)
                for k in range(cols):
                    s += w[k] * xt[k]
                out[t, n] = s


@njit(parallel=True, cache=True, nogil=True)
def _dequantize(q, scales, mins, has_min, group, table, bits, row_ids, out):  # pragma: no cover
    # No fastmath: q * scale + min must round as transformers' float32 dequantization does.
    count, cols = out.shape
    for blk in prange((count + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        se = np.empty(cols, dtype=np.float32)
        me = np.empty(cols, dtype=np.float32)
        for i in range(blk * ROWS_PER_TASK, min(count, (blk + 1) * ROWS_PER_TASK)):
            _decode_row(q, scales, mins, has_min, group, table, bits, row_ids[i], out[i], se, me)


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
    _dequantize(_np(q), _np(scales), _mins_np(mins, scales), mins is not None, group, HALF_TO_FLOAT, bits, ids, out)
    return torch.from_numpy(out)


def quant_matmul(x: torch.Tensor, bits: int, q: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None, group: int) -> torch.Tensor:
    """x [tokens, K] float32 @ w.T -> [tokens, N], w the dequantized [N, K] matrix."""
    x = x.float().contiguous()
    if x.shape[0] > QUANT_GEMV_MAX_TOKENS:
        return tiled_matmul(x, bits, q, scales, mins, group)
    return gemv(x, bits, q, scales, mins, group)


def gemv(x: torch.Tensor, bits: int, q: torch.Tensor, scales: torch.Tensor,
         mins: torch.Tensor | None, group: int) -> torch.Tensor:
    tokens, rows = x.shape[0], q.shape[0]
    out = np.empty((tokens, rows), dtype=np.float32)
    _gemv(_value_order(x.numpy(), bits), _np(q), _np(scales), _mins_np(mins, scales), mins is not None, group, HALF_TO_FLOAT,
          bits, out)
    return torch.from_numpy(out)


_orders: dict[int, np.ndarray] = {}


def _value_order(x: np.ndarray, bits: int) -> np.ndarray:
    """x's columns in the order the gemv decodes an int4 row: the low nibble of each byte (the
    first 16 columns of each run of 32) for every byte, then the high nibbles."""
    if bits != 4:
        return x
    cols = x.shape[1]
    order = _orders.get(cols)
    if order is None:
        runs = np.arange(cols).reshape(cols // 32, 2, 16)
        order = _orders[cols] = np.ascontiguousarray(np.concatenate([runs[:, 0].ravel(), runs[:, 1].ravel()]))
    return np.ascontiguousarray(x[:, order])


def tiled_matmul(x: torch.Tensor, bits: int, q: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None, group: int) -> torch.Tensor:
    qn, sn, mn = _np(q), _np(scales), _mins_np(mins, scales)

    def fill(start: int, end: int, tile: np.ndarray) -> None:
        _dequantize(qn, sn, mn, mins is not None, group, HALF_TO_FLOAT, bits, np.arange(start, end, dtype=np.int64),
                    tile)
    return matmul_by_tiles(x, q.shape[0], fill, ROWS_PER_TASK)
