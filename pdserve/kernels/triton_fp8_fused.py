"""FP8 weights times activations quantized inside the GEMM, for decode batches on CUDA.

The unfused path quantizes a layer's input in torch first (pad, abs, amax, clamp, divide,
convert: about ten small kernels) and then runs the GEMM. A decode step of a 22-layer model
has about 90 quantized linear layers, so those launches cost more than the GEMMs' weight reads
at batch 1. Here each program quantizes the activation tiles it reads, with act_quant's
arithmetic (s = max(amax, 1e-10) / 448, e4m3(clamp(x / s)), IEEE division), so the result is
the unfused path's to float32 rounding and the layer is one launch (two when K is split).

- Block weights (DeepSeek-V3, Qwen3-FP8, compressed-tensors FP8_BLOCK): each K tile is one
  group of 128 columns, so its amax is the tile's row maximum.
- Per-channel / per-tensor weights: one group per token, the whole row; each program finds the
  row's amax in a first pass over x (a few KiB at decode), then runs the K loop.

Weight scales are pdserve's per-row layout, float32 [N, column blocks] (one column per channel).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_quant import block_m_for, split_k_for

BLOCK_K = 128  # a block checkpoint's group, and the K tile of both kinds


@triton.jit
def _rounded_to_e4m3(v):
    """v (in [-448, 448]) rounded to the nearest e4m3 value, ties to even, as float32: torch's
    conversion. The Triton interpreter's own conversion halves a value whose rounding carries
    into the next power of two (127.7 -> 64), so the tests could not check the kernel through it;
    converting the exact result after is right everywhere."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3  # of the e4m3 step at v (-9: subnormal)
    step = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    # adding and taking away 1.5 * 2^23 rounds to an integer, ties to even (|v / step| < 16)
    return ((v * inverse + 12582912.0) - 12582912.0) * step


@triton.jit
def _quantized_tile(xt, amax):
    # act_quant's AMAX_FLOOR (1e-10) and FP8_MAX (448), written out: a jitted function reads constants
    scale = tl.math.div_rn(tl.maximum(amax, 1e-10), 448.0)
    q = tl.clamp(tl.math.div_rn(xt, scale[:, None]), -448.0, 448.0)
    return _rounded_to_e4m3(q).to(tl.float8e4nv), scale


@triton.jit
def _fp8_fused_kernel(x, w, ws, out, m_rows, n_out, k_in, tiles_per_split,
                      s_xm, s_xk, s_wn, s_wk, s_wsn, s_wsk, s_os, s_om, s_on,
                      PER_ROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_ok, n_ok = m < m_rows, n < n_out
    row_amax = tl.zeros([BLOCK_M], tl.float32)
    if PER_ROW:  # one activation group per token: its amax over all of K first
        for kb in range(0, tl.cdiv(k_in, BLOCK_K)):
            k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            xt = tl.load(x + m[:, None] * s_xm + k[None, :] * s_xk, mask=m_ok[:, None] & (k < k_in)[None, :],
                         other=0.0).to(tl.float32)
            row_amax = tl.maximum(row_amax, tl.max(tl.abs(xt), axis=1))
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = split * tiles_per_split
    for kb in range(first, tl.minimum(first + tiles_per_split, tl.cdiv(k_in, BLOCK_K))):
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < k_in
        xt = tl.load(x + m[:, None] * s_xm + k[None, :] * s_xk, mask=m_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        amax = row_amax if PER_ROW else tl.max(tl.abs(xt), axis=1)
        xq, x_scale = _quantized_tile(xt, amax)
        wq = tl.load(w + n[None, :] * s_wn + k[:, None] * s_wk, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        w_scale = tl.load(ws + n * s_wsn + kb * s_wsk, mask=n_ok, other=0.0)
        # FP8 products are exact in float32; the tile's two scales come in once
        acc += tl.dot(xq, wq) * x_scale[:, None] * w_scale[None, :]
    tl.store(out + split * s_os + m[:, None] * s_om + n[None, :] * s_on, acc.to(out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_fused_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     out_dtype: torch.dtype | None = None, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] float; weight [N, K] float8_e4m3fn (or its bytes, uint8); weight_scale float32
    [N, 1] (per channel: activations per token) or [N, ceil(K / 128)] (blocks of 128: activations
    per token and block) -> [M, N] in out_dtype (x's by default)."""
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    rows, cols = x.shape
    n_out = weight.shape[0]
    per_row = weight_scale.shape[1] == 1
    if not per_row and weight_scale.shape[1] != triton.cdiv(cols, BLOCK_K):
        raise ValueError(f"FP8 weight scales [{n_out}, {weight_scale.shape[1]}]: expected one column or "
                         f"one per {BLOCK_K} of {cols} columns")
    block_n = 64 if n_out >= 64 else max(16, triton.next_power_of_2(n_out))
    n_tiles, k_tiles = triton.cdiv(n_out, block_n), triton.cdiv(cols, BLOCK_K)
    split = split_k or split_k_for(rows, n_tiles, k_tiles, x.device)
    tiles_per_split = triton.cdiv(k_tiles, split)
    out_dtype = out_dtype or x.dtype
    out = torch.empty(split, rows, n_out, dtype=out_dtype if split == 1 else torch.float32, device=x.device)
    block_m = block_m_for(rows)
    grid = (triton.cdiv(rows, block_m), n_tiles, split)
    _fp8_fused_kernel[grid](x, weight, weight_scale, out, rows, n_out, cols, tiles_per_split,
                            *x.stride(), *weight.stride(), weight_scale.stride(0),
                            0 if per_row else weight_scale.stride(1), *out.stride(),
                            PER_ROW=per_row, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K)
    return out[0] if split == 1 else out.sum(0).to(out_dtype)

