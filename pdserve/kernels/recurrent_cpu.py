"""Compiled CPU decode steps of the recurrent layers: the gated delta rule (Gated DeltaNet), the
Mamba2 state update and the short causal convolution in front of both, each one call per layer
and step over every decoding request.

Why: the torch steps (gated_delta.recurrent_step, mamba2.recurrent_step,
causal_conv.causal_conv_step) gather the requests' states out of the pool, build several
temporaries the size of all those states (the decayed state, the correction, the product with
q), and scatter the result back: about six passes over memory that is, at 32 requests, several
MB per layer. Here each (request, head) is one work item that reads its state once, updates it
in place in the pool's arena, and writes the output, in float32 as the torch steps compute.

They compute what the torch steps compute, in the same order per element, except that sums may
be reassociated (vectorised) and a multiply-add may be fused. The pool must hold float32 states
on the CPU (`usable`); other dtypes and devices take the torch steps.

Where the compiled library builds, the same steps run from native_recurrent.c instead: on torch's
OpenMP pool (numba's is a second libgomp in the process), with denormals flushed (a strongly
decaying head's e^g and decayed states fall below float32's normal range, each value a
microcode assist: the delta rule's step inside a Qwen3.5-shaped engine 0.58 -> 0.19 ms). The
numba kernels stay for builds without a C compiler.
"""
from __future__ import annotations

import ctypes
import math
import weakref

import numpy as np
import torch
from numba import njit, prange

from pdserve.kernels import native_gemv, numba_threads  # noqa: F401  (numba_threads: before the first parallel call)

_FASTMATH = {"reassoc", "nsz", "contract"}


def usable(*pool_views: torch.Tensor) -> bool:
    """Every view is a float32 CPU slot array whose per-slot part is contiguous (a view of
    StatePool's arena, or a plain tensor)."""
    for view in pool_views:
        if view.dtype != torch.float32 or view.device.type != "cpu" or view.stride()[1:] != _packed(view.shape[1:]):
            return False
    return True


def _packed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A contiguous tensor's strides for this shape."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


_FLAT: dict[int, tuple[weakref.ref, tuple[np.ndarray, int, int]]] = {}


def _arena(view: torch.Tensor) -> tuple[np.ndarray, int, int]:
    """(the whole storage as flat float32, the view's offset in it, one slot's stride), made once
    per pool view: every layer of every step passes the same ones."""
    entry = _FLAT.get(id(view))
    if entry is None or entry[0]() is not view:
        flat = torch.empty(0, dtype=torch.float32).set_(view.untyped_storage()).numpy()
        entry = _FLAT[id(view)] = (weakref.ref(view), (flat, view.storage_offset(), view.stride(0)))
        weakref.finalize(view, _FLAT.pop, id(view), None)
    return entry[1]


def _c32(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float32).contiguous()


def _ptr(x: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(x.data_ptr())


def _ptrs(*xs: torch.Tensor) -> list[ctypes.c_void_p]:
    return [_ptr(x) for x in xs]


def _arena_args(view: torch.Tensor) -> tuple:
    """The compiled steps' view of the pool: its storage's first float, then the view's offset and
    one slot's stride, in floats."""
    return (ctypes.c_void_p(view.untyped_storage().data_ptr()), ctypes.c_long(view.storage_offset()),
            ctypes.c_long(view.stride(0)))


def _slots64(slots: torch.Tensor) -> torch.Tensor:
    return slots if slots.dtype == torch.int64 and slots.is_contiguous() else slots.to(torch.int64).contiguous()


def _f32(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(torch.float32).contiguous().numpy()


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """gated_delta.recurrent_step for one token each of B requests, their states updated in place:
    q, k [B, Hk, dk] (not yet normalised), v [B, Hv, dv], g, beta [B, Hv], states the pool's
    [slots, Hv, dk, dv] float32 view, slots [B]. Returns the output [B, Hv, dv] in v's dtype."""
    lib = native_gemv.library()
    if lib is not None:
        q, k, v32, g, beta = (_c32(t) for t in (q, k, v, g, beta))
        out = torch.empty(v32.shape)
        slots = _slots64(slots)
        lib.pd_gated_delta_step(*_ptrs(q, k, v32, g, beta), v.shape[0], k.shape[1], v.shape[1], k.shape[2], v.shape[2],
                                *_arena_args(states), _ptr(slots), _ptr(out), torch.get_num_threads())
        return out.to(v.dtype)
    flat, offset, stride = _arena(states)
    out = np.empty(v.shape, dtype=np.float32)
    _gated_delta_kernel(_f32(q), _f32(k), _f32(v), _f32(g), _f32(beta), flat, offset, stride,
                        slots.numpy(), out)
    return torch.from_numpy(out).to(v.dtype)


@njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
def _gated_delta_kernel(q, k, v, g, beta, flat, offset, stride, slots, out):  # pragma: no cover
    rows, v_heads, v_dim = v.shape
    k_heads, k_dim = q.shape[1], q.shape[2]
    per_key_head = v_heads // k_heads
    scale = np.float32(k_dim ** -0.5)
    for item in prange(rows * v_heads):
        b, h = item // v_heads, item % v_heads
        kh = h // per_key_head
        # q and k L2-normalised (eps 1e-6 inside the root, as gated_delta.l2norm), q scaled
        qq, kk = np.float32(0.0), np.float32(0.0)
        for i in range(k_dim):
            qq += q[b, kh, i] * q[b, kh, i]
            kk += k[b, kh, i] * k[b, kh, i]
        q_inv = np.float32(1.0) / np.sqrt(qq + np.float32(1e-6))
        k_inv = np.float32(1.0) / np.sqrt(kk + np.float32(1e-6))
        qn = np.empty(k_dim, dtype=np.float32)
        kn = np.empty(k_dim, dtype=np.float32)
        for i in range(k_dim):
            qn[i] = q[b, kh, i] * q_inv * scale
            kn[i] = k[b, kh, i] * k_inv
        base = offset + slots[b] * stride + h * k_dim * v_dim
        decay = np.float32(math.exp(g[b, h]))
        # pass 1: decay the state, and read what it remembers along k
        remembered = np.zeros(v_dim, dtype=np.float32)
        for i in range(k_dim):
            row = flat[base + i * v_dim:base + (i + 1) * v_dim]
            for j in range(v_dim):
                row[j] = row[j] * decay
                remembered[j] += row[j] * kn[i]
        delta = np.empty(v_dim, dtype=np.float32)
        for j in range(v_dim):
            delta[j] = (v[b, h, j] - remembered[j]) * beta[b, h]
        # pass 2: correct the state along k, and read it along q
        acc = np.zeros(v_dim, dtype=np.float32)
        for i in range(k_dim):
            row = flat[base + i * v_dim:base + (i + 1) * v_dim]
            for j in range(v_dim):
                row[j] = row[j] + kn[i] * delta[j]
                acc[j] += row[j] * qn[i]
        out[b, h] = acc


def mamba2_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """mamba2.recurrent_step for one token each of R requests, their states updated in place:
    x [R, H, P], dt [R, H] (discretised), A, D [H], B, C [R, G, N], states the pool's
    [slots, H, P, N] float32 view, slots [R]. Returns y [R, H, P] in x's dtype."""
    lib = native_gemv.library()
    if lib is not None:
        args = [_c32(t) for t in (x, dt, A, B, C, D)]
        out = torch.empty(x.shape)
        slots = _slots64(slots)
        lib.pd_mamba2_step(*_ptrs(*args), *x.shape, *B.shape[1:], *_arena_args(states), _ptr(slots), _ptr(out),
                           torch.get_num_threads())
        return out.to(x.dtype)
    flat, offset, stride = _arena(states)
    out = np.empty(x.shape, dtype=np.float32)
    _mamba2_kernel(_f32(x), _f32(dt), _f32(A), _f32(B), _f32(C), _f32(D), flat, offset, stride,
                   slots.numpy(), out)
    return torch.from_numpy(out).to(x.dtype)


@njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
def _mamba2_kernel(x, dt, A, B, C, D, flat, offset, stride, slots, out):  # pragma: no cover
    rows, heads, head_dim = x.shape
    groups, size = B.shape[1], B.shape[2]
    per_group = heads // groups
    for item in prange(rows * heads):
        r, h = item // heads, item % heads
        grp = h // per_group
        decay = np.float32(math.exp(dt[r, h] * A[h]))
        dt_b = np.empty(size, dtype=np.float32)
        for n in range(size):
            dt_b[n] = dt[r, h] * B[r, grp, n]
        base = offset + slots[r] * stride + h * head_dim * size
        for p in range(head_dim):
            row = flat[base + p * size:base + (p + 1) * size]
            xp = x[r, h, p]
            acc = np.float32(0.0)
            for n in range(size):
                s = row[n] * decay + dt_b[n] * xp
                row[n] = s
                acc += s * C[r, grp, n]
            out[r, h, p] = acc + xp * D[h]


def conv_step(x: torch.Tensor, windows: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """causal_conv.causal_conv_step with the windows updated in place: x [B, C], windows the
    pool's [slots, C, K-1] float32 view, weight [C, K]. Returns [B, C] (no activation) in x's
    dtype."""
    lib = native_gemv.library()
    if lib is not None:
        x32, weight = _c32(x), _c32(weight)
        bias = None if bias is None else _c32(bias)
        out = torch.empty(x32.shape)
        slots = _slots64(slots)
        lib.pd_conv_step(_ptr(x32), *x.shape, weight.shape[1] - 1, *_arena_args(windows), _ptr(slots), _ptr(weight),
                         None if bias is None else _ptr(bias), _ptr(out), torch.get_num_threads())
        return out.to(x.dtype)
    flat, offset, stride = _arena(windows)
    out = np.empty(x.shape, dtype=np.float32)
    has_bias = bias is not None
    _conv_kernel(_f32(x), flat, offset, stride, slots.numpy(), _f32(weight),
                 _f32(bias) if has_bias else np.zeros(1, dtype=np.float32), has_bias, out)
    return torch.from_numpy(out).to(x.dtype)


def conv_spans(x: torch.Tensor, windows: torch.Tensor, spans: list[tuple[int, int, int]], weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor | None:
    """causal_conv.causal_conv over every prefill span of a step in one compiled call, each span's
    window continued and updated in place: x [T, C] float32 (rows in the step's order), windows the
    pool's [slots, C, K-1] float32 view, spans (slot, first row, end row). Returns [T, C] float32
    with the spans' rows written; None without the compiled library."""
    lib = native_gemv.library()
    if lib is None or x.dtype != torch.float32 or x.stride(-1) != 1:
        return None
    taps = weight.detach().float().t().contiguous()  # [K, C]: a row's channels in vectors
    bias = None if bias is None else _c32(bias)
    table = torch.tensor(spans, dtype=torch.int64)
    out = torch.empty(x.shape)
    lib.pd_conv_spans(_ptr(x), ctypes.c_long(x.stride(0)), x.shape[1], weight.shape[1] - 1, *_arena_args(windows),
                      _ptr(table), len(spans), _ptr(taps), None if bias is None else _ptr(bias), _ptr(out),
                      torch.get_num_threads())
    return out


@njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
def _conv_kernel(x, flat, offset, stride, slots, weight, bias, has_bias, out):  # pragma: no cover
    rows, channels = x.shape
    width = weight.shape[1] - 1  # the window: the last K-1 inputs
    for b in prange(rows):
        base = offset + slots[b] * stride
        for c in range(channels):
            w = base + c * width
            acc = np.float32(0.0)
            for t in range(width):
                acc += flat[w + t] * weight[c, t]
            acc += x[b, c] * weight[c, width]
            if width > 0:
                for t in range(width - 1):
                    flat[w + t] = flat[w + t + 1]
                flat[w + width - 1] = x[b, c]
            out[b, c] = acc + bias[c] if has_bias else acc
