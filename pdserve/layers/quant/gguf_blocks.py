"""GGUF's quantized blocks decoded, exactly, into q values with per-group scales and mins
(grouped.GroupedWeight), so the weights stay quantized in memory.

Each type is w = q * scale + min over groups of columns, with these parts (llama.cpp's
ggml-quants.c; the float32 arithmetic below is gguf-py's dequantization, so q * scale + min gives
its float32 values bit for bit):

| type | block | group | q | scale | min |
|------|-------|-------|---|-------|-----|
| Q4_0 | 32 cols, 18 B | 32 | 4-bit | d (f16) | -8 d (f16, exact) |
| Q4_1 | 32 cols, 20 B | 32 | 4-bit | d (f16) | m (f16) |
| Q8_0 | 32 cols, 34 B | 32 | int8 | d (f16) | none |
| Q4_K | 256 cols, 144 B | 32 | 4-bit | d * sc (f32) | -dmin * m (f32) |
| Q5_K | 256 cols, 176 B | 32 | 5-bit (held in 8) | d * sc (f32) | -dmin * m (f32) |
| Q6_K | 256 cols, 210 B | 16 | 6-bit - 32 (int8) | d * sc (f32) | none |

(sc, m: 6-bit sub-block scales and mins of the K types, 8-bit signed for Q6_K.)
"""
from __future__ import annotations

import numpy as np

from pdserve.layers.quant.grouped import GroupedWeight

KEPT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34),
                "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def decode(type_name: str, raw: np.ndarray) -> GroupedWeight:
    """raw: uint8 [rows, row_bytes], each row a run of blocks of `type_name`."""
    block, size = _BLOCK_BYTES[type_name]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, size)
    weight = _DECODERS[type_name](blocks)
    cols = raw.shape[1] // size * block
    weight.q = weight.q.reshape(rows, cols)
    weight.scales = weight.scales.reshape(rows, cols // weight.group)
    if weight.mins is not None:
        weight.mins = weight.mins.reshape(rows, cols // weight.group)
    return weight


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """Blocks of 16 bytes -> 32 values: low nibbles are values 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _q4_0(b: np.ndarray) -> GroupedWeight:
    d = _f16(b[:, :2])
    return GroupedWeight(_nibbles_32(b[:, 2:]), d, (d * np.float16(-8)).astype(np.float16), 32, 4)


def _q4_1(b: np.ndarray) -> GroupedWeight:
    return GroupedWeight(_nibbles_32(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4]), 32, 4)


def _q8_0(b: np.ndarray) -> GroupedWeight:
    return GroupedWeight(np.ascontiguousarray(b[:, 2:]).view(np.int8), _f16(b[:, :2]), None, 32, 8)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: per 32-column sub-block, scale d * sc and min -dmin * m, in float32."""
    d = _f16(b[:, :2]).astype(np.float32)
    dmin = _f16(b[:, 2:4]).astype(np.float32)
    packed = b[:, 4:16].reshape(-1, 3, 4)
    lo, hi, mixed = packed[:, 0], packed[:, 1], packed[:, 2]
    # 12 bytes hold 8 six-bit scales and 8 six-bit mins: the first four of each in the low six
    # bits of bytes 0-3 (scales) and 4-7 (mins); the last four split between bytes 8-11's
    # nibbles and the top two bits of bytes 0-7.
    sc = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _low_high_64(qs: np.ndarray) -> np.ndarray:
    """K types: per 64 columns, 32 bytes whose low nibbles are columns 0..31, high 32..63."""
    runs = qs.reshape(qs.shape[0], -1, 32)
    return np.stack([runs & 15, runs >> 4], axis=2).reshape(qs.shape[0], -1)


def _q4_k(b: np.ndarray) -> GroupedWeight:
    scales, mins = _k_scales(b)
    return GroupedWeight(_low_high_64(b[:, 16:]), scales, mins, 32, 4)


def _q5_k(b: np.ndarray) -> GroupedWeight:
    scales, mins = _k_scales(b)
    high = b[:, 16:48]  # bit i of byte l: the fifth bit of column 32 i + l
    fifth = (high[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = _low_high_64(b[:, 48:]) | (fifth.reshape(b.shape[0], -1) << 4)
    return GroupedWeight(q.astype(np.uint8), scales, mins, 32, 8)


def _q6_k(b: np.ndarray) -> GroupedWeight:
    n = b.shape[0]
    low = b[:, :128].reshape(n, 2, 2, 32)  # [half, bytes 0-31 / 32-63, 32]
    high = b[:, 128:192].reshape(n, 2, 1, 32)
    # Per 128 columns: the low nibbles of 64 bytes give columns 0..63, their high nibbles 64..127;
    # two bits of one of 32 bytes (shift 0, 2, 4, 6 for columns 0, 32, 64, 96 onward) on top.
    low4 = np.concatenate([low & 15, low >> 4], axis=2)  # [half, 4 runs of 32, 32]
    top2 = (high >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = ((low4 | (top2 << 4)).astype(np.int8) - np.int8(32)).reshape(n, 256)
    d = _f16(b[:, 208:210]).astype(np.float32)
    scales = d * np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return GroupedWeight(q, scales, None, 16, 8)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
