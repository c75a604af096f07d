"""Granite 4.0-H (GraniteMoeHybridForCausalLM, model_type granitemoehybrid): Mamba2 layers beside
attention layers (layer_types), each followed by a shared SwiGLU MLP and, with
num_local_experts > 0, a MoE block (top-k logits, softmax over those k) added to it.

What differs from Nemotron-H: Granite's multipliers (the embedding scaled by
embedding_multiplier, each residual branch by residual_multiplier, attention scores by
attention_multiplier, the logits divided by logits_scaling); RoPE on attention when
position_embedding_type is "rope" (none by default); Llama's RMSNorm.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from pdserve.layers.quant.unquantized import FloatLinear
from pdserve.models.decoder import build_and_load
from pdserve.models.hybrid import HybridAttention, HybridDecoderModel, kv_indices, state_indices
from pdserve.models.llama import ModelSpec, RMSNorm
from pdserve.models.mamba2_mixer import Mamba2Mixer, Mamba2Shape, dt_lower_limit
from pdserve.models.moe import DenseMLP, SparseMoE, topk_softmax
from pdserve.models.rope import RotaryEmbedding
from pdserve.models.weights import WeightLoader, check_fields

MAMBA, ATTENTION = "linear_attention", "full_attention"
# checkpoint name part -> this module's (the experts are stacked parameters, no ".weight")
_NAMES = ((".mamba.", ".mixer."), (".self_attn.", ".mixer."),
          (".block_sparse_moe.input_linear.weight", ".moe.experts.gate_up_proj"),
          (".block_sparse_moe.output_linear.weight", ".moe.experts.down_proj"),
          (".block_sparse_moe.router.layer.", ".moe.gate."),
          (".shared_mlp.input_linear.", ".shared_mlp.gate_up_proj."),
          (".shared_mlp.output_linear.", ".shared_mlp.down_proj."))


def check_config(config) -> None:
    check_fields(config, {"hidden_act": ("silu",), "position_embedding_type": (None, "rope"),
                          "attention_bias": (False,), "mamba_proj_bias": (False, True)})
    bad = set(config.layer_types) - {MAMBA, ATTENTION}
    if bad:
        raise ValueError(f"layer_types {sorted(bad)} are not supported; supported: {MAMBA}, {ATTENTION}")
    if config.mamba_n_heads * config.mamba_d_head != int(config.mamba_expand * config.hidden_size):
        raise ValueError("mamba_n_heads * mamba_d_head must equal mamba_expand * hidden_size")
    dt_lower_limit(config)  # refuses an upper limit of dt


class GraniteHybridModel(HybridDecoderModel):
    def __init__(self, *args, logits_scaling: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.logits_scaling = logits_scaling

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lm_head(hidden) / self.logits_scaling).float()


class GraniteHybridLayer(nn.Module):
    def __init__(self, config, spec: ModelSpec, mixer: nn.Module):
        super().__init__()
        self.mixer = mixer
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.shared_mlp = DenseMLP(spec.hidden_size, config.shared_intermediate_size, linear=FloatLinear)
        self.moe = None
        if config.num_local_experts > 0:
            route = functools.partial(topk_softmax, top_k=config.num_experts_per_tok)
            self.moe = SparseMoE(spec.hidden_size, config.intermediate_size, config.num_local_experts, route)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor, cos, sin, ctx) -> torch.Tensor:
        x = x + self.mixer(self.input_layernorm(x), cos, sin, ctx) * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        out = self.shared_mlp(h) if self.moe is None else self.moe(h) + self.shared_mlp(h)
        return x + out * self.residual_multiplier


def model_spec(config) -> ModelSpec:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelSpec(
        architecture=config.architectures[0], vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps, qkv_bias=False, o_bias=False, qk_norm=False,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings, hidden_act=config.hidden_act)


def mamba_shape(config) -> Mamba2Shape:
    return Mamba2Shape(config.hidden_size, config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups,
                       config.mamba_d_state, config.mamba_d_conv, config.mamba_chunk_size, dt_lower_limit(config),
                       config.mamba_conv_bias, config.mamba_proj_bias, config.rms_norm_eps)


def build_model(config, files: list[Path], dtype: torch.dtype, device: torch.device) -> HybridDecoderModel:
    spec = model_spec(config)
    kinds = list(config.layer_types)
    kv, states = kv_indices(kinds, (ATTENTION,)), state_indices(kinds, (MAMBA,))
    rope = config.position_embedding_type == "rope"
    ropes = {"rope": RotaryEmbedding(config, spec.head_dim, spec.max_position_embeddings)} if rope else {}

    def mixer(i: int) -> nn.Module:
        if states[i] is not None:
            return Mamba2Mixer(mamba_shape(config), states[i])
        return HybridAttention(spec, kv[i], scale=config.attention_multiplier)

    def make() -> HybridDecoderModel:
        layers = [GraniteHybridLayer(config, spec, mixer(i)) for i in range(spec.num_layers)]
        return GraniteHybridModel(spec, layers, RMSNorm(spec.hidden_size, spec.rms_norm_eps), ropes,
                                  ["rope" if rope else None] * spec.num_layers, embed_scale=config.embedding_multiplier,
                                  logits_scaling=config.logits_scaling)

    def place(name: str, tensor: torch.Tensor, loader: WeightLoader) -> None:
        for old, new in _NAMES:
            name = name.replace(old, new)
        loader.copy_standard(name, tensor)

    return build_and_load(make, files, place, dtype, device)
