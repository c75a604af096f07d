"""Mamba2's selective state-space scan (the SSD form) in torch.

Per head h, a state S [head_dim, state_size] decays by exp(dt_t A_h) each token and takes in
the token's input along B_t; the output reads the state along C_t, plus a skip D_h x_t:

    S <- exp(dt_t A) S + dt_t x_t B_t^T;  y_t = S C_t + D x_t

B and C come in n_groups groups, each shared by consecutive heads. `recurrent_step` is that
update for one token of many requests (a decode step). `chunked` computes a span chunk by
chunk, as transformers' torch path does: within a chunk an attention-like masked product, and
the states carried between chunks, starting from the request's state (so a prompt split across
steps continues exactly). dt is softplus(dt + dt_bias); the chunked form also clamps it from
below at time_step_min, as the reference does there (and not in its one-token update).
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from pdserve.kernels import denormals, native_gemv


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: entry (i, j) is x[j+1] + ... + x[i] for j <= i, -inf above
    (by masked cumulative sums, as the reference: stabler than differences of one cumsum)."""
    n = x.shape[-1]
    x = x[..., None].expand(*x.shape, n)
    below = torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=-1)
    sums = x.masked_fill(~below, 0).cumsum(dim=-2)
    keep = torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=0)
    return sums.masked_fill(~keep, -torch.inf)


def balanced_chunk(length: int, most: int) -> int:
    """The chunk length for a span: as few chunks as chunks of `most` need, of equal length, so
    the last is not padded out to `most` (a 150-token span at 128: 2 chunks of 75, not 2 of 128
    with 106 padding). The chunked form gives the same sums whatever the chunk; only the work
    shrinks (the within-chunk products grow with the chunk's square). The delta rule
    (gated_delta.chunked) keeps the reference's 64-token chunks: its logits follow transformers'
    within 1e-4 that way, and drifted to 1.2e-4 at 150 tokens in balanced ones."""
    return -(-length // -(-length // most))


def chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
            D: torch.Tensor, state: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's span: x [T, H, P], dt [T, H] (discretised), A, D [H], B, C [T, G, N],
    state [H, P, N]. Returns y [T, H, P] in float32 and the state after the span. On the CPU with
    denormals flushed (denormals.py: the decays across a chunk make blocks of them)."""
    if x.device.type != "cpu":
        return _chunked(x, dt, A, B, C, D, state, chunk)
    compiled = _compiled(x, dt, A, B, C, D, state, balanced_chunk(x.shape[0], chunk))
    if compiled is not None:
        return compiled
    with denormals.flushed():
        return _chunked(x, dt, A, B, C, D, state, chunk)


def _compiled(x, dt, A, B, C, D, state, chunk: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The same scan in native_recurrent.c (per head, chunk by chunk, each chunk's blocks in a
    thread's buffers, denormals flushed; torch's form passed over [heads, chunks, l, l] temporaries
    op by op: 0.27 of a Nemotron-H-shaped run's 0.86 s); None without the compiled library."""
    lib = native_gemv.library()
    if lib is None:
        return None
    x, dt, A, B, C, D = (t.detach().float().contiguous() for t in (x, dt, A, B, C, D))
    state = state.float().contiguous().clone()
    y = torch.empty_like(x)
    length, heads, head_dim = x.shape
    if lib.pd_mamba2_chunked(*(ctypes.c_void_p(t.data_ptr()) for t in (x, dt, A, B, C, D)), length, heads, head_dim,
                             B.shape[1], B.shape[2], chunk, ctypes.c_void_p(state.data_ptr()),
                             ctypes.c_void_p(y.data_ptr()), torch.get_num_threads()) != 0:
        return None
    return y, state


def _chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor, state: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """chunked's arithmetic, laid out heads first ([H, chunks, l, ...]) so every product is one
    batched matmul; C B^T is computed once per group and shared by the group's heads (the
    reference repeats B and C per head first)."""
    length, heads, head_dim = x.shape
    groups = B.shape[1]
    chunk = balanced_chunk(length, chunk)
    pad = (chunk - length % chunk) % chunk
    n = (length + pad) // chunk
    x, dt = x.float(), dt.float()
    skip = D[:, None] * x
    xdt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad)).view(n, chunk, heads, head_dim).permute(2, 0, 1, 3)
    Adt = F.pad(A.float() * dt, (0, 0, 0, pad)).view(n, chunk, heads).permute(2, 0, 1)  # [H, n, l]
    B, C = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)).view(n, chunk, groups, -1).permute(2, 0, 1, 3) for t in (B, C))
    cum = Adt.cumsum(dim=-1)
    # within each chunk: an attention-like product, masked and decayed
    scores = (C @ B.transpose(-1, -2))[:, None] * _by_group(segment_sum(Adt).exp(), groups)
    y = scores.flatten(0, 1) @ xdt  # [H, n, l, P]
    # each chunk's contribution to the state at its end (decayed to the end), [H, n, P, N]
    to_end = _by_group((cum[..., -1:] - cum).exp()[..., None], groups)
    contributions = xdt.transpose(-1, -2) @ (B[:, None] * to_end).flatten(0, 1)
    # the states chained chunk to chunk from the request's, each chunk reading the one it starts with
    chunk_decay = cum[..., -1].exp()[..., None, None]
    current, starts = state.float(), []
    for i in range(n):
        starts.append(current)
        current = current * chunk_decay[:, i] + contributions[:, i]
    starts = torch.stack(starts, dim=1)  # [H, n, P, N]
    C_heads = C[:, None].expand(groups, heads // groups, *C.shape[1:]).flatten(0, 1)
    y = y + (C_heads @ starts.transpose(-1, -2)) * cum.exp()[..., None]
    return y.permute(1, 2, 0, 3).reshape(n * chunk, heads, head_dim)[:length] + skip, current


def _by_group(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[H, ...] -> [G, H / G, ...]: each group's consecutive heads."""
    return x.view(groups, x.shape[0] // groups, *x.shape[1:])


def recurrent_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token each of R requests: x [R, H, P], dt [R, H] (discretised), A, D [H], B, C
    [R, G, N], state [R, H, P, N]. Returns y [R, H, P] in x's dtype and the new states."""
    rows, heads, head_dim = x.shape
    rep = heads // B.shape[1]
    B, C = B.repeat_interleave(rep, dim=1), C.repeat_interleave(rep, dim=1)  # [R, H, N]
    decay = torch.exp(dt.float() * A.float())[..., None, None]
    state = state * decay + (dt[..., None] * B)[:, :, None, :] * x[..., None]
    y = torch.bmm(state.reshape(rows * heads, head_dim, -1).to(C.dtype), C.reshape(rows * heads, -1, 1))
    return (y.view(rows, heads, head_dim) + x * D[:, None]).to(x.dtype), state
