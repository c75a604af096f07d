"""The decode-step matmul of pdserve.kernels.quant_cpu: a few float32 tokens times a
group-quantized weight matrix (int4 or int8, see quant_cpu), reading each weight at its own width.

Why it is shaped this way (SmolLM2's shapes, benchmarks/kernels/bench_quant_ab.py):
- A nibble is widened in float arithmetic: b = float(byte), hi = floor(b / 16), lo = b - 16 hi,
  all exact. numba types `byte & 15` as int64, and the compiler then converted 8 lanes at a time
  (vcvtqq2ps); in float the loop runs 16 lanes wide.
- The per-group min comes out of the sum: sum_k (q_k s_k + m_k) x_k = sum_k q_k s_k x_k +
  sum_g m_g X_g, with X_g the sum of x over group g, computed once per call. This is how
  llama.cpp multiplies Q4_1 too.
- One token (a decode step at concurrency 1): each weight is decoded and multiplied in one pass,
  with no row buffer.
- More tokens: each row is decoded once, into a buffer that stays in L1, and dotted with the
  tokens two rows and four tokens at a time, so each load feeds several multiply-adds.
An int4 row is decoded in value order (all low nibbles, then all high ones: flat loops the
compiler vectorises) and meets the tokens with their columns permuted to match.
Everything is float32: the result is x @ dequantized(w).T up to the order of the sums.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from pdserve.kernels import numba_threads  # noqa: F401  (before the first parallel call)
from pdserve.kernels.quant_scales import HALF_TO_FLOAT, nibbles, scale_value

ROWS_PER_TASK = 16


@njit(cache=True, nogil=True, inline="always")
def _value_order(x, xv):  # pragma: no cover
    """x's columns as an int4 row decodes: of each run of 32, the first 16 (the low nibbles of its
    16 bytes) into the first half of xv, the last 16 into the second half."""
    half = x.shape[1] // 2
    for t in range(x.shape[0]):
        for c in range(half // 16):
            for j in range(16):
                xv[t, c * 16 + j] = x[t, c * 32 + j]
                xv[t, half + c * 16 + j] = x[t, c * 32 + 16 + j]


@njit(cache=True, nogil=True, inline="always")
def _group_sums(x, group, xs):  # pragma: no cover
    for t in range(x.shape[0]):
        for g in range(xs.shape[1]):
            s = np.float32(0.0)
            for k in range(g * group, (g + 1) * group):
                s += x[t, k]
            xs[t, g] = s


@njit(cache=True, nogil=True, inline="always")
def _broadcast(scales, table, n, width, se):  # pragma: no cover
    """se[g * width:(g + 1) * width] = scale g of row n, for each g that fits in se."""
    if width == 16:  # the common widths as constants (explicit loops, or a variable width, were slower)
        for g in range(se.shape[0] // 16):
            se[g * 16:(g + 1) * 16] = scale_value(scales[n, g], table)
    elif width == 32:
        for g in range(se.shape[0] // 32):
            se[g * 32:(g + 1) * 32] = scale_value(scales[n, g], table)
    else:
        for g in range(se.shape[0] // width):
            se[g * width:(g + 1) * width] = scale_value(scales[n, g], table)


@njit(cache=True, nogil=True, inline="always")
def _row_scales(scales, group, table, bits, n, se):  # pragma: no cover
    """se[k]: the scale of row n's k-th decoded value. int4 (value order): for groups of 32k
    columns both nibbles of byte i share a scale, se[i]; for groups of 16 (byte run c holds group
    2c in its low nibbles, 2c + 1 in its high ones) the high nibble's is se[half + i]."""
    if bits == 8:
        _broadcast(scales, table, n, group, se)
        return
    half = se.shape[0] // 2
    if group == 16:
        for c in range(half // 16):
            se[c * 16:(c + 1) * 16] = scale_value(scales[n, 2 * c], table)
            se[half + c * 16:half + (c + 1) * 16] = scale_value(scales[n, 2 * c + 1], table)
        return
    _broadcast(scales, table, n, group // 2, se[:half])


@njit(cache=True, nogil=True, inline="always")
def _min_term(mins, has_min, table, n, xs_t):  # pragma: no cover
    s = np.float32(0.0)
    if has_min:
        for g in range(xs_t.shape[0]):
            s += scale_value(mins[n, g], table) * xs_t[g]
    return s


@njit(cache=True, nogil=True, inline="always")
def _dot_one(qrow, bits, group, se, xt):  # pragma: no cover
    """sum_k q_k * se_k * x_k, decoding as it goes."""
    s = np.float32(0.0)
    if bits == 8:
        for k in range(xt.shape[0]):
            s += np.float32(qrow[k]) * se[k] * xt[k]
        return s
    half = xt.shape[0] // 2
    if group == 16:
        for i in range(half):
            lo, hi = nibbles(qrow[i])
            s += lo * se[i] * xt[i] + hi * se[half + i] * xt[half + i]
    else:  # both nibbles of a byte share a scale: one multiply by it
        for i in range(half):
            lo, hi = nibbles(qrow[i])
            s += (lo * xt[i] + hi * xt[half + i]) * se[i]
    return s


@njit(cache=True, nogil=True, inline="always")
def _decode(qrow, bits, group, se, w):  # pragma: no cover
    if bits == 8:
        for k in range(w.shape[0]):
            w[k] = np.float32(qrow[k]) * se[k]
        return
    half = w.shape[0] // 2
    if group == 16:
        for i in range(half):
            lo, hi = nibbles(qrow[i])
            w[i] = lo * se[i]
            w[half + i] = hi * se[half + i]
    else:
        for i in range(half):
            lo, hi = nibbles(qrow[i])
            w[i] = lo * se[i]
            w[half + i] = hi * se[i]


@njit(cache=True, nogil=True, inline="always")
def _put(out, t, n, s, mins, has_min, table, xs):  # pragma: no cover
    out[t, n] = s + _min_term(mins, has_min, table, n, xs[t])


@njit(cache=True, nogil=True, inline="always")
def _dot_tokens(w0, w1, x, xs, mins, has_min, table, n0, n1, out):  # pragma: no cover
    """out[t, n0] = w0 . x[t] and out[t, n1] = w1 . x[t] (+ the min terms) for every token: two
    rows and four tokens per pass, so each load of a weight or of x feeds several multiply-adds
    (8 to 25% faster than one row on SmolLM2's Q4_1 shapes at 8 and 16 tokens)."""
    tokens, cols = x.shape
    t = 0
    while t + 4 <= tokens:
        x0, x1, x2, x3 = x[t], x[t + 1], x[t + 2], x[t + 3]
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
        for k in range(cols):
            u, v = w0[k], w1[k]
            c0, c1, c2, c3 = x0[k], x1[k], x2[k], x3[k]
            a0 += u * c0
            a1 += u * c1
            a2 += u * c2
            a3 += u * c3
            b0 += v * c0
            b1 += v * c1
            b2 += v * c2
            b3 += v * c3
        _put(out, t, n0, a0, mins, has_min, table, xs)
        _put(out, t + 1, n0, a1, mins, has_min, table, xs)
        _put(out, t + 2, n0, a2, mins, has_min, table, xs)
        _put(out, t + 3, n0, a3, mins, has_min, table, xs)
        _put(out, t, n1, b0, mins, has_min, table, xs)
        _put(out, t + 1, n1, b1, mins, has_min, table, xs)
        _put(out, t + 2, n1, b2, mins, has_min, table, xs)
        _put(out, t + 3, n1, b3, mins, has_min, table, xs)
        t += 4
    for r in range(t, tokens):
        xt = x[r]
        a = b = np.float32(0.0)
        for k in range(cols):
            a += w0[k] * xt[k]
            b += w1[k] * xt[k]
        _put(out, r, n0, a, mins, has_min, table, xs)
        _put(out, r, n1, b, mins, has_min, table, xs)


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _gemv(x, q, scales, mins, has_min, group, table, bits, out):  # pragma: no cover
    tokens, cols = x.shape
    rows = q.shape[0]
    xs = np.zeros((tokens, cols // group), dtype=np.float32)
    if has_min:
        _group_sums(x, group, xs)
    if bits == 4:
        xv = np.empty_like(x)
        _value_order(x, xv)
    else:
        xv = x
    for blk in prange((rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        start, end = blk * ROWS_PER_TASK, min(rows, (blk + 1) * ROWS_PER_TASK)
        se = np.empty(cols, dtype=np.float32)
        if tokens == 1:
            for n in range(start, end):
                _row_scales(scales, group, table, bits, n, se)
                out[0, n] = _dot_one(q[n], bits, group, se, xv[0]) + _min_term(mins, has_min, table, n, xs[0])
            continue
        w0 = np.empty(cols, dtype=np.float32)
        w1 = np.empty(cols, dtype=np.float32)
        for n in range(start, end, 2):
            m = min(n + 1, end - 1)  # an odd last row pairs with itself
            _row_scales(scales, group, table, bits, n, se)
            _decode(q[n], bits, group, se, w0)
            _row_scales(scales, group, table, bits, m, se)
            _decode(q[m], bits, group, se, w1)
            _dot_tokens(w0, w1, xv, xs, mins, has_min, table, n, m, out)


def gemv(x: np.ndarray, bits: int, q: np.ndarray, scales: np.ndarray, mins: np.ndarray, has_min: bool,
         group: int) -> np.ndarray:
    """x [tokens, K] float32 (contiguous) @ w.T -> [tokens, N]; q, scales, mins as quant_cpu holds
    them (numpy views; mins an empty array when has_min is False)."""
    out = np.empty((x.shape[0], q.shape[0]), dtype=np.float32)
    _gemv(x, q, scales, mins, has_min, group, HALF_TO_FLOAT, bits, out)
    return out
