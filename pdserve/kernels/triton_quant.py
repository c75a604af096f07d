"""Quantized-weight GEMMs in Triton: the CUDA path of pdserve's FP8 block and grouped int4
layers (CPU under TRITON_INTERPRET=1 in tests). Each kernel has a torch reference beside it.

- fp8_block_matmul: activations quantized per token in groups of `block` columns
  (act_quant's scheme), e4m3 weights with one scale per row block and column block. Each K tile
  is one column block, so its two scales multiply the tile's FP8 dot product inside the K loop
  and the weights are never widened in memory.
- grouped_matmul (W4A16/W8A16): pdserve's grouped format (layers/quant/grouped.py) unpacked in
  registers, w = q * scale + min per group, with a split-K path so a decode batch of a few
  tokens still spreads over every SM.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
AMAX_FLOOR = 1e-10  # as act_quant: an all-zero group still gets a finite scale
BLOCK_M = 16  # tl.dot's smallest M; a decode batch of one token pads to it


def block_m_for(rows: int) -> int:
    """Rows per tile: 16 for decode batches, up to 64 for larger ones (fewer reloads of each
    weight tile, which is what these GEMMs read most)."""
    return BLOCK_M if rows <= BLOCK_M else 32 if rows <= 32 else 64


def per_token_group_quant_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q float8_e4m3fn [M, K], scale float32 [M, ceil(K / group)]), the values
    act_quant.fp8_quant_dequant multiplies (x_q * scale is its result)."""
    tokens, cols = x.shape
    groups = math.ceil(cols / group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - cols)).view(tokens, groups, group)
    scale = padded.abs().amax(-1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    q = (padded / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(tokens, groups * group)[:, :cols].contiguous(), scale.view(tokens, groups)


@triton.jit
def _fp8_block_kernel(x, xs, w, ws, out, m_rows, n_out, k_in, scale_row_div,
                      s_xm, s_xk, s_xsm, s_xsk, s_wn, s_wk, s_wsn, s_wsk, s_om, s_on,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < m_rows, n < n_out
    scale_rows = n // scale_row_div  # 1: a scale per row (pdserve's layout); 128: the checkpoint's
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(k_in, BLOCK_K)):
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < k_in
        xq = tl.load(x + m[:, None] * s_xm + k[None, :] * s_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wq = tl.load(w + n[None, :] * s_wn + k[:, None] * s_wk, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        x_scale = tl.load(xs + m * s_xsm + kb * s_xsk, mask=m_ok, other=0.0)
        w_scale = tl.load(ws + scale_rows * s_wsn + kb * s_wsk, mask=n_ok, other=0.0)
        # FP8 products are exact in float32; the block's scales come in once per tile
        acc += tl.dot(xq, wq) * x_scale[:, None] * w_scale[None, :]
    tl.store(out + m[:, None] * s_om + n[None, :] * s_on, acc.to(out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_block_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: int = 128,
                     scale_row_block: int = 1, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] float; weight [N, K] float8_e4m3fn (or its bytes, uint8); weight_scale float32
    [ceil(N / scale_row_block), ceil(K / block)] (w = weight * scale: DeepSeek's
    weight_scale_inv with scale_row_block 128, or pdserve's per-row layout with 1) -> [M, N]."""
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    xq, x_scale = per_token_group_quant_fp8(x, block)
    rows, cols = x.shape
    n_out = weight.shape[0]
    out = torch.empty(rows, n_out, dtype=out_dtype or x.dtype, device=x.device)
    block_n = 64 if n_out >= 64 else max(16, triton.next_power_of_2(n_out))
    block_m = block_m_for(rows)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n_out, block_n))
    _fp8_block_kernel[grid](xq, x_scale, weight, weight_scale, out, rows, n_out, cols, scale_row_block,
                            *xq.stride(), *x_scale.stride(), *weight.stride(), *weight_scale.stride(),
                            *out.stride(), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block)
    return out


def fp8_block_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: int = 128,
                        scale_row_block: int = 1) -> torch.Tensor:
    """fp8_block_matmul in plain float32 torch: dequantized activations times dequantized weights."""
    xq, x_scale = per_token_group_quant_fp8(x, block)
    cols = x.shape[1]
    x_dq = xq.float() * x_scale.repeat_interleave(block, 1)[:, :cols]
    w_scale = weight_scale.float().repeat_interleave(scale_row_block, 0)[:weight.shape[0]]
    w_dq = weight.view(torch.float8_e4m3fn).float() * w_scale.repeat_interleave(block, 1)[:, :cols]
    return x_dq @ w_dq.t()


@triton.jit
def _dot_acc(acc, a, w, IEEE: tl.constexpr):
    if IEEE:
        return acc + tl.dot(a.to(tl.float32), w, input_precision="ieee")
    return acc + tl.dot(a, w.to(a.dtype))


@triton.jit
def _grouped_kernel(x, q, sc, mn, out, m_rows, n_out, k_in, tiles_per_split,
                    s_xm, s_xk, s_qn, s_qk, s_sn, s_sg, s_os, s_om, s_on,
                    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, IEEE: tl.constexpr,
                    NIBBLE_DOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_ok, n_ok = m < m_rows, n < n_out
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = split * tiles_per_split
    for kb in range(first, tl.minimum(first + tiles_per_split, tl.cdiv(k_in, BLOCK_K))):
        g = (kb * BLOCK_K) // GROUP  # BLOCK_K divides GROUP: one scale (and min) per row per tile
        scale = tl.load(sc + n * s_sn + g * s_sg, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_MIN:
            low = tl.load(mn + n * s_sn + g * s_sg, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        else:
            low = tl.zeros([1, BLOCK_N], tl.float32)
        if BITS == 4 and NIBBLE_DOTS:
            # the tile's bytes as stored (contiguous along K, so the loads are wide), each nibble
            # half dotted with the activation columns it holds: in each run of 32 columns, byte j
            # holds column j (low nibble) and column j + 16 (high nibble), quant_cpu's order
            byte = kb * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(q + n[None, :] * s_qn + byte[:, None] * s_qk, mask=n_ok[None, :], other=0)
            low_col = (byte // 16) * 32 + byte % 16
            for half in tl.static_range(2):
                a = tl.load(x + m[:, None] * s_xm + (low_col + 16 * half)[None, :] * s_xk, mask=m_ok[:, None],
                            other=0.0)
                acc = _dot_acc(acc, a, ((packed >> (4 * half)) & 15).to(tl.float32) * scale + low, IEEE)
        else:
            k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            a = tl.load(x + m[:, None] * s_xm + k[None, :] * s_xk, mask=m_ok[:, None], other=0.0)
            if BITS == 4:
                # quant_cpu's order, gathered per column (each byte loaded twice)
                byte = (k // 32) * 16 + k % 16
                shift = ((k % 32) // 16) * 4
                packed = tl.load(q + n[None, :] * s_qn + byte[:, None] * s_qk, mask=n_ok[None, :], other=0)
                wq = ((packed >> shift[:, None].to(tl.uint8)) & 15).to(tl.float32)
            else:
                wq = tl.load(q + n[None, :] * s_qn + k[:, None] * s_qk, mask=n_ok[None, :], other=0).to(tl.float32)
            acc = _dot_acc(acc, a, wq * scale + low, IEEE)
    tl.store(out + split * s_os + m[:, None] * s_om + n[None, :] * s_on, acc,
             mask=m_ok[:, None] & n_ok[None, :])


def split_k_for(m_rows: int, n_tiles: int, k_tiles: int, device: torch.device) -> int:
    """Split K only for decode batches (one M tile) whose N tiles leave SMs idle: about two
    programs per SM, each keeping at least 4 K tiles."""
    if m_rows > BLOCK_M or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(2 * sms // max(n_tiles, 1), k_tiles // 4))


def grouped_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                   bits: int, group: int, split_k: int | None = None, nibble_dots: bool = True) -> torch.Tensor:
    """x [M, K] @ w.T for the grouped weight w [N, K] = q * scale + min -> [M, N] in x's dtype.
    q: uint8 [N, K / 2] (4 bits) or int8 [N, K]; scales, mins: float16/float32 [N, K / group].
    nibble_dots False: 4-bit tiles gathered column by column (the first kernel, for comparison)."""
    rows, cols = x.shape
    n_out = q.shape[0]
    block_k = math.gcd(group, 64)  # a divisor of the group, so a tile has one scale per row
    block_n = 64 if n_out >= 64 else max(16, triton.next_power_of_2(n_out))
    n_tiles, k_tiles = triton.cdiv(n_out, block_n), triton.cdiv(cols, block_k)
    split = split_k or split_k_for(rows, n_tiles, k_tiles, x.device)
    tiles_per_split = triton.cdiv(k_tiles, split)
    partial = torch.empty(split, rows, n_out, dtype=torch.float32, device=x.device)
    block_m = block_m_for(rows)
    grid = (triton.cdiv(rows, block_m), n_tiles, split)
    _grouped_kernel[grid](x, q, scales, mins if mins is not None else scales, partial, rows, n_out, cols,
                          tiles_per_split, *x.stride(), *q.stride(), *scales.stride(), *partial.stride(),
                          BITS=bits, GROUP=group, HAS_MIN=mins is not None, IEEE=x.dtype == torch.float32,
                          NIBBLE_DOTS=nibble_dots and block_k >= 32,  # tl.dot takes K >= 16
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    y = partial[0] if split == 1 else partial.sum(0)
    return y.to(x.dtype)


def grouped_dequantize(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
                       group: int) -> torch.Tensor:
    """The grouped weight in float32, in torch (any device): grouped_matmul's reference."""
    if bits == 4:
        rows = q.shape[0]
        runs = q.reshape(rows, -1, 16)
        values = torch.stack([runs & 15, runs >> 4], dim=2).reshape(rows, -1).float()
    else:
        values = q.float()
    w = values * scales.float().repeat_interleave(group, 1)
    return w + mins.float().repeat_interleave(group, 1) if mins is not None else w


def grouped_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                      bits: int, group: int) -> torch.Tensor:
    return x.float() @ grouped_dequantize(q, scales, mins, bits, group).t()
