"""Round-to-nearest quantizers for GGUF's K types (Q4_K, Q5_K, Q6_K), which gguf-py can read
but not write. They produce valid blocks of llama.cpp's layout (not llama.cpp's search for the
best scales): enough to write test checkpoints that transformers and pdserve both load.
Checked against gguf-py's dequantization in tests/test_gguf_quantized.py."""
from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


def quantize(data: np.ndarray, qtype) -> np.ndarray:
    """gguf.quantize, with the K types added: [rows, cols] float32 -> uint8 [rows, row_bytes]."""
    if qtype not in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return gguf.quantize(data, qtype)
    rows = data.shape[0]
    blocks = data.astype(np.float32).reshape(-1, 256)
    out = _q6_k(blocks) if qtype == Q.Q6_K else _q45_k(blocks, 15 if qtype == Q.Q4_K else 31)
    return out.reshape(rows, -1)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _q45_k(blocks: np.ndarray, top: int) -> np.ndarray:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale_f, min_f = (sub.max(-1) - low) / top, -low
    d = (scale_f.max(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = (min_f.max(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale_f / np.where(d == 0, 1, d)), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(min_f / np.where(dmin == 0, 1, dmin)), 0, 63).astype(np.uint8)
    step = (d * sc)[..., None]
    q = np.clip(np.round((sub + (dmin * mn)[..., None]) / np.where(step == 0, 1, step)), 0, top).astype(np.uint8)
    packed = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)
    pairs = q.reshape(n, 4, 2, 32)  # per 64 columns: low nibbles 0..31, high nibbles 32..63
    qs = ((pairs[:, :, 0] & 15) | ((pairs[:, :, 1] & 15) << 4)).reshape(n, 128)
    parts = [_f16_bytes(d), _f16_bytes(dmin), packed]
    if top == 31:  # the fifth bit of column 32 i + l is bit i of byte l
        fifth = (q.reshape(n, 8, 32) >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]
        parts.append(fifth.sum(1).astype(np.uint8))
    return np.concatenate(parts + [qs], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale_f = np.abs(sub).max(-1) / 31
    d = (scale_f.max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale_f / np.where(d == 0, 1, d)), 1, 127).astype(np.int8)
    step = (d * sc)[..., None]
    q = (np.clip(np.round(sub / step), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [half, run, 32]
    ql = (q[:, :, :2] & 15) | ((q[:, :, 2:] & 15) << 4)  # runs 0,1 low nibbles; 2,3 high
    qh = ((q >> 4) << np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]).sum(2).astype(np.uint8)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)
