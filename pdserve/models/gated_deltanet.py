"""The Gated DeltaNet token mixer (Qwen3.5's linear-attention layers) over per-request state slots.

Per token: q/k/v come out of one projection and a short causal convolution (SiLU), z gates the
output, b gives beta = sigmoid(b) (how far the state moves to the new value), and a gives the
decay g = -exp(A_log) * softplus(a + dt_bias). The delta rule (pdserve.kernels.gated_delta)
mixes the tokens; each head's output is RMS-normalised and gated by SiLU(z).

The step's rows come in the model runner's order: one-token queries first, batched over their
requests in one recurrent update; then each prefill chunk, in the chunked form from the state
its request reached. Every request's convolution window and recurrent state live in its slot
(ctx.states, pdserve.engine.state_pool), `state_index` naming this layer's among the model's
stateful layers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import gated_delta, recurrent_cpu
from pdserve.layers.quant.unquantized import FloatLinear
from pdserve.models.state_conv import convolve_runs
from pdserve.models.state_layers import LayerStateSpec


class RMSNormGated(nn.Module):
    """RMSNorm over each head's output, then times SiLU(gate), as transformers' RMSNormGated."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * x32.to(dtype)) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config, state_index: int):
        super().__init__()
        self.state_index = state_index
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_size, self.value_size = self.k_dim * self.num_k_heads, self.v_dim * self.num_v_heads
        self.conv_size = 2 * self.key_size + self.value_size
        self.kernel = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        self.conv1d = nn.Conv1d(self.conv_size, self.conv_size, self.kernel, groups=self.conv_size, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = RMSNormGated(self.v_dim, config.rms_norm_eps)
        self.out_proj = FloatLinear(self.value_size, hidden, bias=False)
        self.in_proj_qkv = FloatLinear(hidden, self.conv_size, bias=False)
        self.in_proj_z = FloatLinear(hidden, self.value_size, bias=False)
        self.in_proj_b = FloatLinear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = FloatLinear(hidden, self.num_v_heads, bias=False)
        # The pool's window and state hold every head (at any TP degree, as the KV cache does):
        # this layer's channels of the window ((first, count) runs) and its first value head.
        # Tensor parallelism cuts them (pdserve.models.tp_shard_hybrid).
        self.full_conv_size, self.full_v_heads = self.conv_size, self.num_v_heads
        self.conv_parts: list[tuple[int, int]] = [(0, self.conv_size)]
        self.first_v_head = 0

    def state_spec(self, dtype: torch.dtype, state_dtype: torch.dtype) -> LayerStateSpec:
        return LayerStateSpec((self.full_conv_size, self.kernel - 1), dtype,
                              (self.full_v_heads, self.k_dim, self.v_dim), state_dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The convolution's input [T, q | k | v], the gate z [T, Hv * dv], b and a [T, Hv]."""
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        tokens = x.shape[0]
        mixed, z, b, a = self.project(x)
        mixed = self._convolve(mixed, ctx.states)
        q, k, v = F.silu(mixed).split([self.key_size, self.key_size, self.value_size], dim=-1)
        q = q.view(tokens, self.num_k_heads, self.k_dim)
        k = k.view(tokens, self.num_k_heads, self.k_dim)
        v = v.view(tokens, self.num_v_heads, self.v_dim)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = self._mix(q, k, v, g, b.sigmoid(), ctx.states)
        out = self.norm(out.reshape(tokens * self.num_v_heads, self.v_dim), z.reshape(tokens * self.num_v_heads, self.v_dim))
        return self.out_proj(out.view(tokens, self.value_size))

    def _convolve(self, mixed: torch.Tensor, states) -> torch.Tensor:
        """The causal convolution of every row, continuing each request's window (updated)."""
        return convolve_runs(mixed, states.pool.conv[self.state_index], self.conv1d.weight[:, 0], None,
                             self.conv_parts, states)

    def _mix(self, q, k, v, g, beta, states) -> torch.Tensor:
        """The delta rule over every row, from and into each request's recurrent state."""
        pool, d = states.pool.state[self.state_index], states.num_decodes
        if self.num_v_heads != self.full_v_heads:  # a tensor-parallel rank's heads of it
            pool = pool.narrow(1, self.first_v_head, self.num_v_heads)
        compiled = recurrent_cpu.usable(pool)  # compiled, the states updated in place
        out = gated_delta.spans_compiled(q, k, v, g, beta, pool, states.spans) if compiled and states.spans else None
        if out is not None:  # every prompt span in one call: only the decode rows are left
            if d:
                out[:d] = recurrent_cpu.gated_delta_step(q[:d], k[:d], v[:d], g[:d], beta[:d], pool, states.slots)
            return out
        pieces = []
        if d and compiled:
            pieces.append(recurrent_cpu.gated_delta_step(q[:d], k[:d], v[:d], g[:d], beta[:d], pool, states.slots))
        elif d:
            out, new = gated_delta.recurrent_step(q[:d], k[:d], v[:d], g[:d], beta[:d], pool[states.slots])
            pool[states.slots] = new.to(pool.dtype)
            pieces.append(out)
        for slot, start, end in states.spans:
            rows = slice(start, end)
            out, new = gated_delta.chunked(q[rows], k[rows], v[rows], g[rows], beta[rows], pool[slot])
            pool[slot] = new.to(pool.dtype)
            pieces.append(out)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


class GroupedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's layout of the same layer: two projections, each grouped by key head.
    in_proj_qkvz gives, per key head, its q, its k, then the v and z of its value heads;
    in_proj_ba gives, per key head, the b then the a of its value heads."""

    def __init__(self, config, state_index: int):
        super().__init__(config, state_index)
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a
        hidden = config.hidden_size
        self.in_proj_qkvz = FloatLinear(hidden, 2 * self.key_size + 2 * self.value_size, bias=False)
        self.in_proj_ba = FloatLinear(hidden, 2 * self.num_v_heads, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tokens, groups, per = x.shape[0], self.num_k_heads, self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(tokens, groups, -1)
        q, k, v, z = qkvz.split([self.k_dim, self.k_dim, per * self.v_dim, per * self.v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(tokens, groups, 2 * per).split([per, per], dim=-1)
        mixed = torch.cat([t.reshape(tokens, -1) for t in (q, k, v)], dim=-1)
        return mixed, z.reshape(tokens, -1), b.reshape(tokens, -1), a.reshape(tokens, -1)
