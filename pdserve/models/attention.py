"""Self-attention over the paged KV cache for the model families with a module of their own:
fused qkv, optional q/k norms, a sliding window and learned attention sinks per layer.

window W > 0: a query at position i sees keys at positions i-W+1..i (transformers'
sliding_window semantics). sinks [heads]: one extra logit per head in the softmax's
denominator, with no value (gpt-oss). Both are passed to the kernels through the
AttentionContext, so every path (prefill, chunked prefill, decode, cached prefixes) applies them.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pdserve.models.rope import RotaryEmbedding


class PagedAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int, *,
                 qkv_bias: bool = False, o_bias: bool = False, scale: float | None = None,
                 window: int = 0, sinks: bool = False,
                 qk_norm: Callable[[int], nn.Module] | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=o_bias)
        self.q_norm = qk_norm(head_dim) if qk_norm else None
        self.k_norm = qk_norm(head_dim) if qk_norm else None
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window = window

    def shard_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(q, k, cos, sin)
        out = ctx.attention(self.layer_idx, q, k, v, self.scale, window=self.window, sinks=self.sinks)
        return self.o_proj(out.reshape(tokens, self.q_size))


class RopeTable(RotaryEmbedding):
    """A RoPE table from given inverse frequencies (for configs with one RoPE per layer type)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int):
        self.inv_freq, self.scaling = inv_freq.float(), scaling
        self._table = self._build_table(max_positions)
