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

import torch
import torch.nn.functional as F


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: entry (i, j) is x[j+1] + ... + x[i] for j <= i, -inf above
    (by masked cumulative sums, as the reference: stabler than differences of one cumsum)."""
    n = x.shape[-1]
    x = x[..., None].expand(*x.shape, n)
    below = torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=-1)
    sums = x.masked_fill(~below, 0).cumsum(dim=-2)
    keep = torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=0)
    return sums.masked_fill(~keep, -torch.inf)


def chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
            D: torch.Tensor, state: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's span: x [T, H, P], dt [T, H] (discretised), A, D [H], B, C [T, G, N],
    state [H, P, N]. Returns y [T, H, P] in float32 and the state after the span."""
    length, heads = x.shape[0], x.shape[1]
    rep = heads // B.shape[1]
    B = B.float().repeat_interleave(rep, dim=1)
    C = C.float().repeat_interleave(rep, dim=1)
    x = x.float()
    skip = D[:, None] * x
    pad = (chunk - length % chunk) % chunk
    xdt = F.pad(x * dt[..., None].float(), (0, 0, 0, 0, 0, pad)).reshape(-1, chunk, heads, x.shape[-1])
    Adt = F.pad(A.float() * dt.float(), (0, 0, 0, pad)).reshape(-1, chunk, heads).permute(2, 0, 1)  # [H, c, l]
    B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)).reshape(-1, chunk, heads, t.shape[-1]) for t in (B, C))
    cum = Adt.cumsum(dim=-1)
    # within each chunk: an attention-like product, masked and decayed
    scores = torch.einsum("clhn,cshn->clsh", C, B) * segment_sum(Adt).exp().permute(1, 2, 3, 0)
    y = torch.einsum("clsh,cshp->clhp", scores, xdt)
    # each chunk's contribution to the state at its end, then the states chained chunk to chunk
    decayed_B = B * (cum[:, :, -1:] - cum).exp().permute(1, 2, 0)[..., None]
    states = torch.einsum("clhn,clhp->chpn", decayed_B, xdt)
    states = torch.cat([state.float()[None], states])
    chain = segment_sum(F.pad(cum[:, :, -1], (1, 0))).exp()  # [H, to chunk, from chunk]
    states = torch.einsum("hcz,zhpn->chpn", chain, states)
    starts, final = states[:-1], states[-1]
    # what each chunk reads from the state it starts with
    y = y + torch.einsum("clhn,chpn->clhp", C, starts) * cum.exp().permute(1, 2, 0)[..., None]
    return y.reshape(-1, heads, x.shape[-1])[:length] + skip, final


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
