"""CPU kernels over group-quantized weights: w[n, k] = q[n, k] * scale[n, k // group] (+ min[n, k // group]).

Two storage widths, one arithmetic:
- int4: q in 0..15, two per byte. Each run of 32 columns is 16 bytes; byte j holds column j in
  its low nibble and column j + 16 in its high nibble (GGUF's Q4_0/Q4_1 block order, so those
  load without reordering).
- int8: q as int8, one per byte.

Scales and mins are float32, or float16 kept as their raw 16 bits (see quant_scales).

Two ways to multiply, chosen by the number of tokens (see QUANT_GEMV_MAX_TOKENS):
- gemv (quant_gemv): the weights are decoded as they are read, at 4 or 8 bits instead of 32;
  decode steps are memory-bound. Up to native_gemv.max_tokens() tokens its compiled kernel runs
  instead, where it builds (32; 256 on AVX2, where its panels beat the tiles below; 128 under
  bf16 products on AMX's tiles);
- dequantize a tile of rows to float32, multiply it by BLAS, next tile: prefill is
  compute-bound, and the dequantization is amortised over its tokens.
Both multiply the float32 values transformers computes when it dequantizes the same checkpoint
(q * scale + min, in float32); only the order of the sums differs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit, prange

from pdserve.kernels import dequant_tiles, native_gemv, numba_threads, quant_gemv  # noqa: F401  (numba_threads: before the first parallel call)
from pdserve.kernels.dequant_tiles import matmul_by_tiles
from pdserve.kernels.quant_scales import HALF_TO_FLOAT, scale_value

# Up to this many tokens the fused gemv kernel beats dequantize + BLAS (measured on the 2-core
# CPU machine for SmolLM2's shapes, benchmarks/kernels/bench_quant_matmul.py).
QUANT_GEMV_MAX_TOKENS = 16
ROWS_PER_TASK = 16


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
            se[g * group:(g + 1) * group] = scale_value(scales[n, g], table)
            if has_min:
                me[g * group:(g + 1) * group] = scale_value(mins[n, g], table)
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
            sc = scale_value(scales[n, g], table)
            mn = scale_value(mins[n, g], table) if has_min else np.float32(0.0)
            start = base + 16 * h
            for j in range(16):
                b = qrow[c * 16 + j]
                w[start + j] = np.float32((b >> np.uint8(4 * h)) & np.uint8(15)) * sc + mn


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


@dataclass(frozen=True)
class PackedMatrix:
    """One quantized matrix's parameters as the kernels take them (numpy views of the layer's
    tensors, made once: building them costs several microseconds a call, against a kernel of
    60 us on SmolLM2's o_proj at one token)."""
    bits: int
    group: int
    q: np.ndarray
    scales: np.ndarray
    mins: np.ndarray  # empty when has_min is False
    has_min: bool
    native: tuple | None = None  # native_gemv's arguments for this matrix, None where it cannot take it
    int8_pack: np.ndarray | None = None  # its codes in the int8 products' order, where they run

    @classmethod
    def of(cls, bits: int, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
           group: int) -> PackedMatrix:
        qn, sn, mn = _np(q), _np(scales), _mins_np(mins, scales)
        native = native_gemv.matrix_args(bits, qn, sn, mn, mins is not None, group)
        cols = qn.shape[1] * 8 // bits
        pack = (native_gemv.int8_pack(native, cols)
                if native is not None and bits in (4, 8) and dequant_tiles.int8_products() else None)
        if pack is not None:
            native = native_gemv.with_int8_pack(native, pack)
        return cls(bits, group, qn, sn, mn, mins is not None, native, pack)


def quant_matmul(x: torch.Tensor, bits: int, q: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None, group: int) -> torch.Tensor:
    """x [tokens, K] float32 @ w.T -> [tokens, N], w the dequantized [N, K] matrix."""
    return packed_matmul(x, PackedMatrix.of(bits, q, scales, mins, group))


def packed_matmul(x: torch.Tensor, m: PackedMatrix) -> torch.Tensor:
    """quant_matmul over a PackedMatrix."""
    x = x.float().contiguous()
    if m.native is not None and (x.shape[0] <= native_gemv.max_tokens() or int8_native(m, x.shape[0])):  # compiled
        out = torch.empty(x.shape[0], m.q.shape[0])
        if native_gemv.run(x.data_ptr(), x.shape[0], x.shape[1], m.native, out.data_ptr()):
            return out
    return _tiled(x, m) if x.shape[0] > QUANT_GEMV_MAX_TOKENS else _gemv(x, m)


def int8_native(m: PackedMatrix, rows: int) -> bool:
    """Whether the compiled kernel takes m's products of `rows` tokens at any count: int8 products
    of 4- and 8-bit codes in groups of 32 (dequant_tiles.int8_products), faster than bf16 tiles."""
    return dequant_tiles.int8_products(rows) and m.bits in (4, 8) and m.group % 32 == 0


def gemv(x: torch.Tensor, bits: int, q: torch.Tensor, scales: torch.Tensor,
         mins: torch.Tensor | None, group: int) -> torch.Tensor:
    return _gemv(x.float().contiguous(), PackedMatrix.of(bits, q, scales, mins, group))


def _gemv(x: torch.Tensor, m: PackedMatrix) -> torch.Tensor:
    return torch.from_numpy(quant_gemv.gemv(x.numpy(), m.bits, m.q, m.scales, m.mins, m.has_min, m.group))


def tiled_matmul(x: torch.Tensor, bits: int, q: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None, group: int) -> torch.Tensor:
    return _tiled(x, PackedMatrix.of(bits, q, scales, mins, group))


def _tiled(x: torch.Tensor, m: PackedMatrix) -> torch.Tensor:
    def fill(start: int, end: int, tile: np.ndarray) -> None:
        _dequantize(m.q, m.scales, m.mins, m.has_min, m.group, HALF_TO_FLOAT, m.bits,
                    np.arange(start, end, dtype=np.int64), tile)
    return matmul_by_tiles(x, m.q.shape[0], fill, ROWS_PER_TASK, m.native)
