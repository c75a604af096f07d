"""Scales, mins and nibbles of pdserve's group-quantized CPU kernels, inside compiled code.

They are float32, or float16 kept as their raw 16 bits (uint16) where the checkpoint stores
float16 (GGUF Q4_0, Q4_1, Q8_0): that halves their bytes. numba has no float16 on CPU, so the
kernels widen them through a 65536-entry table, exactly.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

HALF_TO_FLOAT = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)


def scale_value(s, table):  # pragma: no cover  (replaced by the overload in compiled code)
    return s


@overload(scale_value)
def _scale_value_impl(s, table):
    if isinstance(s, types.Integer):  # float16 bits
        return lambda s, table: table[s]
    return lambda s, table: np.float32(s)


@njit(cache=True, nogil=True, inline="always")
def nibbles(b):  # pragma: no cover
    """(low, high) nibble of byte b as float32, widened in float arithmetic (all exact): numba
    types `b & 15` as int64, and the compiler then converted 8 lanes at a time (vcvtqq2ps)
    where float runs 16 wide."""
    bf = np.float32(b)
    hi = np.floor(bf * np.float32(0.0625))
    return bf - np.float32(16.0) * hi, hi
