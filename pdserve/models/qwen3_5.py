"""Qwen3.5 text (Qwen3_5ForCausalLM, model_type qwen3_5_text): Gated DeltaNet layers beside
full-attention layers (layer_types; by default three linear layers before each full one).

What differs from Qwen3: the linear-attention layers (pdserve.models.gated_deltanet), which keep
a per-request state instead of KV; the attention's q projection also yields a per-head output
gate (the output is multiplied by sigmoid(gate) before o_proj); RoPE turns only the first
partial_rotary_factor of each head's dimensions; every RMSNorm scales by (1 + w), as Gemma's.
The rotary table is transformers' multimodal one, which for text (one position on all three
axes) is the plain table over the rotary dimensions.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pdserve.layers.quant.unquantized import FloatLinear
from pdserve.models.decoder import build_and_load
from pdserve.models.gated_deltanet import GatedDeltaNet
from pdserve.models.gemma3 import GemmaRMSNorm
from pdserve.models.hybrid import HybridDecoderModel, kv_indices, state_indices
from pdserve.models.llama import ModelSpec
from pdserve.models.moe import DenseMLP
from pdserve.models.rope import RotaryEmbedding
from pdserve.models.weights import WeightLoader, check_fields

LINEAR, FULL = "linear_attention", "full_attention"


def check_config(config) -> None:
    check_fields(config, {"hidden_act": ("silu",), "attention_bias": (False,)})
    bad = set(config.layer_types) - {LINEAR, FULL}
    if bad:
        raise ValueError(f"layer_types {sorted(bad)} are not supported; supported: {LINEAR}, {FULL}")
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.rope_type {rope['rope_type']!r} is not supported; supported: 'default'")
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")


class GatedAttention(nn.Module):
    """Attention with a sigmoid output gate per head and partial RoPE; q/k normed per head."""

    def __init__(self, spec: ModelSpec, kv_index: int, rotary_dim: int):
        super().__init__()
        self.kv_index, self.rotary_dim = kv_index, rotary_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        # q_proj's rows: per head, head_dim query rows then head_dim gate rows
        self.qkv_proj = FloatLinear(spec.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = FloatLinear(self.q_size, spec.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.scale = spec.head_dim ** -0.5

    def shard_sizes(self) -> list[int]:
        return [2 * self.q_size, self.kv_size, self.kv_size]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        tokens = x.shape[0]
        q_gate, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = q_gate.view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim))
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        r = self.rotary_dim
        q_rot, k_rot = RotaryEmbedding.apply(q[..., :r], k[..., :r], cos, sin)
        q, k = torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)
        out = ctx.attention(self.kv_index, q.contiguous(), k.contiguous(), v, self.scale)
        out = out.reshape(tokens, self.q_size) * torch.sigmoid(gate.reshape(tokens, self.q_size))
        return self.o_proj(out)


class Qwen35DecoderLayer(nn.Module):
    def __init__(self, config, spec: ModelSpec, mixer: nn.Module, mlp: nn.Module | None = None):
        super().__init__()
        self.mixer = mixer  # GatedDeltaNet (checkpoint: linear_attn) or GatedAttention (self_attn)
        self.mlp = mlp if mlp is not None else DenseMLP(spec.hidden_size, spec.intermediate_size, linear=FloatLinear)
        self.input_layernorm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        x = x + self.mixer(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


def model_spec(config) -> ModelSpec:
    return ModelSpec(
        architecture=config.architectures[0], vocab_size=config.vocab_size,
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps, qkv_bias=False, o_bias=False, qk_norm=True,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings, hidden_act=config.hidden_act)


def _mixer(config, spec: ModelSpec, kv_index: int | None, state_index: int | None, rotary_dim: int) -> nn.Module:
    if state_index is not None:
        return GatedDeltaNet(config, state_index)
    return GatedAttention(spec, kv_index, rotary_dim)


def checkpoint_name(name: str) -> str | None:
    """The module's parameter name for a checkpoint tensor's (without 'model.'); None: not ours
    (the multi-token-prediction head, a vision tower). The image-text model keeps its language
    model under language_model.*."""
    if name.startswith(("mtp.", "visual.")):
        return None
    name = name.removeprefix("language_model.")
    return name.replace(".linear_attn.", ".mixer.").replace(".self_attn.", ".mixer.")


def rotary_dim(config) -> int:
    """The rotated part of each attention head (partial_rotary_factor of head_dim)."""
    partial = (config.rope_parameters or {}).get("partial_rotary_factor", 1.0)
    return int(config.head_dim * partial)


def build_model(config, files: list[Path], dtype: torch.dtype, device: torch.device, *,
                model_class: type[HybridDecoderModel] = HybridDecoderModel,
                rope: RotaryEmbedding | None = None) -> HybridDecoderModel:
    """model_class and rope: the image-text model's (qwen3_5_vl: positions on three axes)."""
    spec = model_spec(config)
    rotary = rotary_dim(config)
    rope = rope or RotaryEmbedding(config, rotary, spec.max_position_embeddings)
    kv = kv_indices(config.layer_types, (FULL,))
    states = state_indices(config.layer_types, (LINEAR,))

    def make() -> HybridDecoderModel:
        layers = [Qwen35DecoderLayer(config, spec, _mixer(config, spec, kv[i], states[i], rotary))
                  for i in range(spec.num_layers)]
        return model_class(spec, layers, GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps),
                                  {"rope": rope}, ["rope"] * spec.num_layers)

    def place(name: str, tensor: torch.Tensor, loader: WeightLoader) -> None:
        name = checkpoint_name(name)
        if name is not None:
            loader.copy_standard(name, tensor)

    return build_and_load(make, files, place, dtype, device)
