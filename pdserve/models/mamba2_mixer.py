"""The Mamba2 token mixer (Nemotron-H's Mamba layers) over per-request state slots.

One projection gives the output gate z, the convolved part (x, B, C) and dt per head. The short
causal convolution (with bias, then SiLU) continues the request's window; the selective scan
(pdserve.kernels.mamba2) continues its state. The output is gated by SiLU(z), RMS-normalised
in n_groups groups, and projected back.

Rows come in the model runner's order (one-token queries first, batched; then each prefill
chunk), each request's window and state in its slot (ctx.states), as the Gated DeltaNet's
(pdserve.models.gated_deltanet).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import mamba2, recurrent_cpu
from pdserve.layers.quant.unquantized import FloatLinear
from pdserve.models.state_conv import convolve_runs
from pdserve.models.state_layers import LayerStateSpec


class GroupRMSNormGated(nn.Module):
    """x * SiLU(gate), RMS-normalised within each of `groups` equal groups, times w."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps = groups, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        grouped = h.view(*h.shape[:-1], self.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view(h.shape).to(dtype)


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba2 layer's sizes and settings, as each family's config names them."""
    hidden: int
    heads: int
    head_dim: int
    groups: int
    state_size: int
    kernel: int
    chunk: int
    dt_min: float  # the lower clamp of dt in the chunked scan (time_step_limit[0], dt_lower_limit)
    conv_bias: bool
    proj_bias: bool
    eps: float


def dt_lower_limit(config) -> float:
    """The chunked scan's lower clamp of dt: the config's time_step_limit, (0, inf) where unset.
    Only the lower bound is supported (every published checkpoint's upper one is inf). Not
    time_step_min, which only initialises dt_bias: transformers before 5.25 clamped Nemotron-H's
    dt at time_step_min, 5.25 reads time_step_limit as NVIDIA's own modeling code does."""
    low, high = getattr(config, "time_step_limit", None) or (0.0, math.inf)
    if high != math.inf:
        raise ValueError(f"time_step_limit {(low, high)} is not supported: only an upper limit of inf")
    return float(low)


class Mamba2Mixer(nn.Module):
    def __init__(self, shape: Mamba2Shape, state_index: int):
        super().__init__()
        self.state_index = state_index
        self.heads, self.head_dim = shape.heads, shape.head_dim
        self.groups, self.state_size = shape.groups, shape.state_size
        self.inner = self.heads * self.head_dim
        self.conv_size = self.inner + 2 * self.groups * self.state_size
        self.kernel, self.chunk, self.dt_min = shape.kernel, shape.chunk, shape.dt_min
        self.in_proj = FloatLinear(shape.hidden, self.inner + self.conv_size + self.heads, bias=shape.proj_bias)
        self.conv1d = nn.Conv1d(self.conv_size, self.conv_size, self.kernel, groups=self.conv_size,
                                bias=shape.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GroupRMSNormGated(self.inner, self.groups, shape.eps)
        self.out_proj = FloatLinear(self.inner, shape.hidden, bias=shape.proj_bias)
        # The pool's window and state hold every head (at any TP degree, as the KV cache does):
        # this layer's channels of the window ((first, count) runs: its x, B and C) and its first
        # head. Tensor parallelism cuts them (pdserve.models.tp_shard_hybrid).
        self.full_conv_size, self.full_heads = self.conv_size, self.heads
        self.conv_parts: list[tuple[int, int]] = [(0, self.conv_size)]
        self.first_head = 0

    def state_spec(self, dtype: torch.dtype, state_dtype: torch.dtype) -> LayerStateSpec:
        return LayerStateSpec((self.full_conv_size, self.kernel - 1), dtype,
                              (self.full_heads, self.head_dim, self.state_size), state_dtype)

    def forward(self, x: torch.Tensor, cos, sin, ctx) -> torch.Tensor:
        tokens = x.shape[0]
        gate, xbc, dt = self.in_proj(x).split([self.inner, self.conv_size, self.heads], dim=-1)
        xbc = F.silu(self._convolve(xbc, ctx.states))
        xs, B, C = xbc.split([self.inner, self.groups * self.state_size, self.groups * self.state_size], dim=-1)
        xs = xs.view(tokens, self.heads, self.head_dim)
        B = B.view(tokens, self.groups, self.state_size)
        C = C.view(tokens, self.groups, self.state_size)
        dt = F.softplus(dt + self.dt_bias)
        y = self._scan(xs, dt, B, C, ctx.states)
        return self.out_proj(self.norm(y.reshape(tokens, self.inner), gate).to(x.dtype))

    def _convolve(self, xbc: torch.Tensor, states) -> torch.Tensor:
        return convolve_runs(xbc, states.pool.conv[self.state_index], self.conv1d.weight[:, 0], self.conv1d.bias,
                             self.conv_parts, states)

    def _scan(self, xs, dt, B, C, states) -> torch.Tensor:
        pool, d = states.pool.state[self.state_index], states.num_decodes
        if self.heads != self.full_heads:  # a tensor-parallel rank's heads of it
            pool = pool.narrow(1, self.first_head, self.heads)
        A = -torch.exp(self.A_log.float())
        pieces = []
        if d and recurrent_cpu.usable(pool):  # compiled, the states updated in place
            pieces.append(recurrent_cpu.mamba2_step(xs[:d], dt[:d], A, B[:d], C[:d], self.D, pool, states.slots))
        elif d:
            y, new = mamba2.recurrent_step(xs[:d], dt[:d], A, B[:d], C[:d], self.D, pool[states.slots].float())
            pool[states.slots] = new.to(pool.dtype)
            pieces.append(y)
        for slot, start, end in states.spans:
            rows = slice(start, end)
            y, new = mamba2.chunked(xs[rows], dt[rows].clamp(min=self.dt_min), A, B[rows], C[rows], self.D,
                                    pool[slot], self.chunk)
            pool[slot] = new.to(pool.dtype)
            pieces.append(y.to(xs.dtype))
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]
