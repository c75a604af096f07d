"""The gated delta rule (Gated DeltaNet, Qwen3.5's and Qwen3-Next's linear attention) in torch.

Per value head, a state S [k_dim, v_dim] is decayed by exp(g_t) each token, then corrected
towards the token's value along its key (the delta rule), and read by the query:

    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t

`recurrent_step` is that update for one token of many requests at once (a decode step).
`chunked` is the same recurrence over a long span, computed chunk by chunk with matmuls (the
WY/UT form, as transformers' and FLA's torch paths): within a chunk every token's correction
is solved from one triangular system, and the state is carried from chunk to chunk. Both take
and return the state, so a prompt split across steps (chunked prefill) continues where the last
step stopped. q and k are L2-normalised and q scaled by k_dim^-0.5 in float32 here, as the
reference does inside its kernels.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from pdserve.kernels import native_gemv

CHUNK = 64  # the reference's chunk length for prefill


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, num_v_heads: int):
    """Heads-first float32 [H, T, d] q (normalised, scaled), k (normalised), v; g, beta [H, T].
    q/k heads are repeated to the value heads (each serves consecutive value heads)."""
    rep = num_v_heads // q.shape[1]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q, k, v = (x.transpose(0, 1).float().contiguous() for x in (q, k, v))
    g, beta = g.transpose(0, 1).float(), beta.transpose(0, 1).float()
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's span: q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv], state [Hv, dk, dv]
    (float32). Returns the output [T, Hv, dv] in v's dtype and the state after the span."""
    length, dtype = q.shape[0], v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, v.shape[1])
    compiled = _compiled(q, k, v, g, beta, state, chunk)
    if compiled is not None:
        out, state = compiled
        return out.transpose(0, 1).to(dtype), state
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    heads, n = v.shape[0], (length + pad) // chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(heads, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(heads, n, chunk).cumsum(-1)  # log of the decay from the chunk's start to t
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair  # unit lower-triangular once the diagonal is 1
    intra = (q @ k.transpose(-1, -2)) * pair
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                              unitriangular=True)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    state = state.float()
    out = torch.empty_like(values)
    for i in range(n):  # the state carried through the chunks in order
        corrected = values[:, i] - k_decayed[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ corrected
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ corrected
    out = out.reshape(heads, n * chunk, -1)[:, :length]
    return out.transpose(0, 1).to(dtype), state


def _compiled(q, k, v, g, beta, state, chunk: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The same over _prepare's heads-first float32 tensors in native_delta.c (each 64 x 64 block
    kept in a thread's buffers: torch's form passed over [heads, chunks, 64, 64] intermediates op
    by op); None without the compiled library or on another device."""
    lib = native_gemv.library() if q.device.type == "cpu" else None
    if lib is None:
        return None
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    state = state.float().contiguous().clone()
    out = torch.empty_like(v)
    heads, length, dk = k.shape
    if lib.pd_gated_delta_chunked(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), heads,
                                  length, dk, v.shape[-1], state.data_ptr(), out.data_ptr(), chunk,
                                  torch.get_num_threads()) != 0:
        return None
    return out, state


def spans_compiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   pool: torch.Tensor, spans: list[tuple[int, int, int]], chunk: int = CHUNK) -> torch.Tensor | None:
    """Every prefill span of a step through `chunked`'s arithmetic in one compiled call
    (native_delta.c pd_gated_delta_spans), from the step's token-major rows as the layer has them
    (q, k [T, Hk, dk] not yet normalised, v [T, Hv, dv], g, beta [T, Hv], float32 on the CPU),
    each span's state updated in place in the pool's float32 view [slots, Hv, dk, dv] (spans:
    (slot, first row, end row)). Returns the output [T, Hv, dv] with the spans' rows written; None
    where the compiled library or the tensors' layout does not allow it."""
    lib = native_gemv.library() if q.device.type == "cpu" else None
    rows_ok = all(x.dtype == torch.float32 and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] for x in (q, k, v))
    if lib is None or not rows_ok:
        return None
    g, beta = (x.float().contiguous() for x in (g, beta))
    out = torch.empty(v.shape)
    table = torch.tensor(spans, dtype=torch.int64)
    ptr = ctypes.c_void_p
    failed = lib.pd_gated_delta_spans(
        *(ptr(x.data_ptr()) for x in (q, k, v, g, beta)), *(ctypes.c_long(x.stride(0)) for x in (q, k, v)),
        k.shape[1], v.shape[1], k.shape[2], v.shape[2], ptr(pool.untyped_storage().data_ptr()),
        ctypes.c_long(pool.storage_offset()), ctypes.c_long(pool.stride(0)), ptr(table.data_ptr()), len(spans),
        ptr(out.data_ptr()), chunk, torch.get_num_threads())
    if failed == -2:  # (a thread's buffers could not be had: some spans' states may have moved on)
        raise MemoryError("pd_gated_delta_spans: no memory for a thread's chunk buffers")
    return None if failed else out


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token each of B requests: q, k [B, Hk, dk], v [B, Hv, dv], g, beta [B, Hv], state
    [B, Hv, dk, dv]. Returns the output [B, Hv, dv] in v's dtype and the new states."""
    dtype = v.dtype
    q, k, v, g, beta = (x.transpose(0, 1) for x in _prepare(q, k, v, g, beta, v.shape[1]))
    state = state.float() * g.exp()[..., None, None]
    remembered = (state * k[..., None]).sum(dim=-2)
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2).to(dtype), state
