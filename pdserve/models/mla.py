"""Multi-head latent attention (DeepSeek-V2/V3) over pdserve's paged latent cache.

Each token's K/V is compressed to one latent shared by all heads: kv_lora_rank values (after
kv_a_layernorm) and qk_rope_head_dim values of the rotated key. Only that latent is cached,
one plane per layer: cache view [num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim].

- Prefill expands the latents into K/V per head through kv_b_proj, as transformers does, and
  runs causal attention over them (a cached prefix is read back from the cache and expanded).
- Decode uses the absorbed form: W_UK (kv_b_proj's key rows) is folded into the query, so each
  head attends straight over the cached latents, and W_UV (its value rows) is applied to the
  attention output. No per-head K/V is ever built for the context.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.kernels import mla_ops
from pdserve.models.llama import RMSNorm
from pdserve.models.rope import RotaryEmbedding

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


@dataclass
class MLASpec:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    rope_interleave: bool
    softmax_scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(qk_head_dim: int, rope_params: dict) -> float:
    """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 for a scaled RoPE that names
    mscale_all_dim (transformers' yarn_apply_mscale: the softmax half of yarn's temperature)."""
    scale = qk_head_dim ** -0.5
    if rope_params.get("rope_type", rope_params.get("type", "default")) != "default":
        mscale_all_dim = rope_params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = yarn_mscale(rope_params["factor"], mscale_all_dim)
            scale *= m * m
    return scale


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ...; the output is de-interleaved (all first
    halves, then all second halves), as transformers writes it. Queries and keys get the same
    order, so their dot products are those of the interleaved rotation."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLAttention(nn.Module):
    def __init__(self, spec: MLASpec, layer_idx: int):
        super().__init__()
        self.spec, self.layer_idx = spec, layer_idx
        h, qk = spec.num_heads, spec.qk_head_dim
        if spec.q_lora_rank is None:
            self.q_proj = nn.Linear(spec.hidden_size, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(spec.hidden_size, spec.q_lora_rank, bias=spec.attention_bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(spec.hidden_size, spec.latent_dim, bias=spec.attention_bias)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(spec.kv_lora_rank, h * (spec.qk_nope_head_dim + spec.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * spec.v_head_dim, spec.hidden_size, bias=spec.attention_bias)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.spec.num_heads, self.spec.qk_head_dim)

    def _rope(self, q_pe: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        if self.spec.rope_interleave:
            return rope_interleaved(q_pe, cos, sin), rope_interleaved(k_pe, cos, sin)
        return RotaryEmbedding.apply(q_pe, k_pe, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        """x [T, hidden]; cos/sin [T, 1, qk_rope_head_dim]; ctx: the step's AttentionContext."""
        s, tokens = self.spec, x.shape[0]
        q_nope, q_pe = self._queries(x).split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        compressed, k_pe = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self._rope(q_pe, k_pe[:, None, :], cos, sin)
        latent = torch.cat([self.kv_a_layernorm(compressed), k_pe[:, 0]], dim=-1)
        cache, meta = ctx.layer_caches[self.layer_idx][0], ctx.meta
        mla_ops.store_latent(latent, cache, meta.slot_mapping)
        ctx.layer_stored(self.layer_idx)
        d = meta.num_decodes
        parts = []
        if d:
            parts.append(self._decode(q_nope[:d], q_pe[:d], cache, meta, mla_ops.latent_decode_for(ctx.ops)))
        if d < tokens:
            parts.append(self._prefill(torch.cat([q_nope[d:], q_pe[d:]], dim=-1), latent[d:], cache, meta))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(out.reshape(tokens, s.num_heads * s.v_head_dim))

    def _kv_b_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, qk_nope, kv_lora] and W_UV [heads, v_head, kv_lora] (views of kv_b_proj)."""
        s = self.spec
        w = self.kv_b_proj.weight.view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        return w[:, :s.qk_nope_head_dim], w[:, s.qk_nope_head_dim:]

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta,
                latent_decode=mla_ops.paged_latent_decode) -> torch.Tensor:
        """Absorbed attention for one-token queries: [D, heads, v_head_dim]."""
        w_uk, w_uv = self._kv_b_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [D, heads, kv_lora]
        q = torch.cat([q_latent, q_pe], dim=-1)
        out_latent = latent_decode(q, cache, self.spec.kv_lora_rank, meta.decode_block_tables,
                                                 meta.decode_context_lens, self.spec.softmax_scale)
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _prefill(self, q: torch.Tensor, latent_new: torch.Tensor, cache: torch.Tensor, meta) -> torch.Tensor:
        """Expanded attention for prefill chunks: [P, heads, v_head_dim]. A sequence with a
        cached prefix reads its whole context's latents back from the cache."""
        cu_q = meta.prefill_cu_seqlens.tolist()
        parts, cu_k = [], [0]
        for i, ctx_len in enumerate(meta.prefill_context_lens.tolist()):
            start, end = cu_q[i], cu_q[i + 1]
            if ctx_len == end - start:
                parts.append(latent_new[start:end])
            else:
                parts.append(mla_ops.gather_latent(cache, meta.prefill_block_tables[i], ctx_len))
            cu_k.append(cu_k[-1] + ctx_len)
        k, v = self.expand_latent(parts[0] if len(parts) == 1 else torch.cat(parts))
        return mla_ops.prefill_attention(q, k, v, cu_q, cu_k, self.spec.softmax_scale)

    def expand_latent(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [N, latent_dim] -> keys [N, heads, qk_head_dim], values [N, heads, v_head_dim]."""
        s, n = self.spec, latent.shape[0]
        compressed, k_pe = latent.split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(compressed).view(n, s.num_heads, s.qk_nope_head_dim + s.v_head_dim)
        k_nope, v = kv.split([s.qk_nope_head_dim, s.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(n, s.num_heads, s.qk_rope_head_dim)], dim=-1)
        return k, v
