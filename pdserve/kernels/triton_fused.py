"""Fused elementwise ops for the Llama layers on CUDA: residual add + RMSNorm, rotary embedding
(in place on the q/k views of the fused qkv output) and SiLU(gate) * up.

Why: in a decode step these ops each ran as 4-10 tiny kernels per layer (casts, pow, mean,
rsqrt, muls, a cat for rotate_half), about 40% of the step's GPU time at 256 sequences. Each
is one kernel here. They round where the torch modules of pdserve.models.llama round (to the
activation dtype after each op that torch runs as its own kernel), so bfloat16 results match
those modules up to the order of the float32 sum in the norm.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x, delta, w, out, sum_out, n_cols, eps, s_x, s_d, s_o, s_s,
                     HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    xv = tl.load(x + row * s_x + cols, mask=ok, other=0.0)
    if HAS_DELTA:  # the residual add, rounded to the activation dtype as torch's `x + delta`
        dv = tl.load(delta + row * s_d + cols, mask=ok, other=0.0)
        xv = (xv.to(tl.float32) + dv.to(tl.float32)).to(xv.dtype)
        tl.store(sum_out + row * s_s + cols, xv, mask=ok)
    xf = xv.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    normed = (xf * inv_rms).to(xv.dtype)  # RMSNorm: normalise in fp32, back to the input dtype
    wv = tl.load(w + cols, mask=ok, other=0.0)
    tl.store(out + row * s_o + cols, (wv.to(tl.float32) * normed.to(tl.float32)).to(out.dtype.element_ty),
             mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)) for x, delta [T, hidden]; without delta, (x, RMSNorm(x))."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if delta is not None else x
    if rows:
        block = triton.next_power_of_2(cols)
        _rms_norm_kernel[(rows,)](
            x, delta if delta is not None else x, weight, out, summed, cols, eps,
            x.stride(0), (delta if delta is not None else x).stride(0), out.stride(0), summed.stride(0),
            HAS_DELTA=delta is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 8))
    return summed, out


@triton.jit
def _rope_kernel(q, k, cos, sin, n_q, n_k, half, s_qt, s_qh, s_kt, s_kh, s_ct,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]
    d_ok = d < half
    c1 = tl.load(cos + tok * s_ct + d, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos + tok * s_ct + half + d, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin + tok * s_ct + d, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin + tok * s_ct + half + d, mask=d_ok, other=0.0).to(tl.float32)
    _rotate(q + tok * s_qt + h * s_qh + d, half, (h < n_q) & d_ok, c1, c2, s1, s2)
    _rotate(k + tok * s_kt + h * s_kh + d, half, (h < n_k) & d_ok, c1, c2, s1, s2)


@triton.jit
def _rotate(ptr, half, ok, c1, c2, s1, s2):
    """x * cos + rotate_half(x) * sin, each product and the sum rounded to x's dtype as torch."""
    x1 = tl.load(ptr, mask=ok, other=0.0)
    x2 = tl.load(ptr + half, mask=ok, other=0.0)
    dt = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = (a1 * c1).to(dt).to(tl.float32) + (-a2 * s1).to(dt).to(tl.float32)
    o2 = (a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)
    tl.store(ptr, o1.to(dt), mask=ok)
    tl.store(ptr + half, o2.to(dt), mask=ok)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding in place: q [T, H, D], k [T, Hk, D] (strided views allowed, unit stride
    in D); cos, sin [T, 1, D] in q's dtype (RotaryEmbedding.cos_sin)."""
    tokens, heads, dim = q.shape
    if not tokens:
        return
    cos, sin = cos.reshape(tokens, dim).contiguous(), sin.reshape(tokens, dim).contiguous()
    _rope_kernel[(tokens,)](q, k, cos, sin, heads, k.shape[1], dim // 2, q.stride(0), q.stride(1),
                            k.stride(0), k.stride(1), cos.stride(0),
                            BLOCK_H=triton.next_power_of_2(max(heads, k.shape[1])),
                            BLOCK_HALF=triton.next_power_of_2(dim // 2))


@triton.jit
def _silu_mul_kernel(gate_up, out, n_cols, s_in, s_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(gate_up + row * s_in + cols, mask=ok, other=0.0)
    u = tl.load(gate_up + row * s_in + n_cols + cols, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu, rounded as its own kernel would
    tl.store(out + row * s_out + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [T, 2 * I] (gate first): [T, I]."""
    rows, width = gate_up.shape
    cols = width // 2
    out = torch.empty(rows, cols, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(cols, block))](gate_up, out, cols, gate_up.stride(0),
                                                           out.stride(0), BLOCK=block)
    return out
