"""Qwen3-MoE, Qwen2-MoE (shared expert with its sigmoid gate) and Mixtral over the paged cache.

The three differ only in their attention's norms and biases and in their MoE block: all route
with a softmax over every expert and take the top k (Qwen renormalises those k weights when
norm_topk_prob is set, Mixtral always does). Layers listed in mlp_only_layers, or off the
decoder_sparse_step, have a dense MLP instead.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from pdserve.models.attention import PagedAttention
from pdserve.models.decoder import DecoderModel, build_and_load
from pdserve.models.llama import ModelSpec, RMSNorm, layer_windows
from pdserve.models.moe import DenseMLP, SparseMoE, experts_graph_safe, softmax_topk
from pdserve.models.moe_decoder import MoeDecoderModel
from pdserve.models.rope import SUPPORTED_ROPE_TYPES, RotaryEmbedding, rope_type_of
from pdserve.models.weights import WeightLoader, check_fields

QWEN3, QWEN2, MIXTRAL = "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"
# Mixtral's checkpoint names -> the Qwen-MoE names this module uses.
_MIXTRAL_NAMES = (("block_sparse_moe.", "mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                  (".w2.", ".down_proj."))


def check_config(config) -> None:
    check_fields(config, {"hidden_act": ("silu", "swish"), "tie_word_embeddings": (False, True)})
    if rope_type_of(config) not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type_of(config)!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if _num_experts(config) < _arch_top_k(config):
        raise ValueError(f"num_experts_per_tok {config.num_experts_per_tok} exceeds the "
                         f"{_num_experts(config)} experts")
    if config.architectures[0] == QWEN2 and (config.shared_expert_intermediate_size or 0) <= 0:
        raise ValueError("Qwen2-MoE without a shared expert (shared_expert_intermediate_size 0) "
                         "is not supported")


def _num_experts(config) -> int:
    return getattr(config, "num_experts", None) or config.num_local_experts


def _arch_top_k(config) -> int:
    return config.num_experts_per_tok


def _is_sparse(config, layer: int) -> bool:
    if config.architectures[0] == MIXTRAL:
        return True
    return (layer not in (config.mlp_only_layers or []) and _num_experts(config) > 0
            and (layer + 1) % config.decoder_sparse_step == 0)


class MoeDecoderLayer(nn.Module):
    def __init__(self, config, spec: ModelSpec, layer: int):
        super().__init__()
        arch = config.architectures[0]
        norm = functools.partial(RMSNorm, eps=spec.rms_norm_eps) if arch == QWEN3 else None
        self.self_attn = PagedAttention(
            spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, layer,
            qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, window=layer_windows(config)[layer], qk_norm=norm)
        if _is_sparse(config, layer):
            route = functools.partial(softmax_topk, top_k=config.num_experts_per_tok,
                                      renormalize=arch == MIXTRAL or bool(config.norm_topk_prob))
            intermediate = config.intermediate_size if arch == MIXTRAL else config.moe_intermediate_size
            shared = config.shared_expert_intermediate_size if arch == QWEN2 else 0
            self.mlp = SparseMoE(spec.hidden_size, intermediate, _num_experts(config), route,
                                 shared_intermediate=shared, shared_gate=arch == QWEN2)
        else:
            self.mlp = DenseMLP(spec.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


def model_spec(config) -> ModelSpec:
    arch = config.architectures[0]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    bias = bool(getattr(config, "qkv_bias" if arch == QWEN2 else "attention_bias", False))
    return ModelSpec(
        architecture=arch, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim, rms_norm_eps=config.rms_norm_eps, qkv_bias=bias,
        o_bias=bias and arch == QWEN3, qk_norm=arch == QWEN3,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings, hidden_act=config.hidden_act)


def build_model(config, files: list[Path], dtype: torch.dtype, device: torch.device) -> DecoderModel:
    spec = model_spec(config)
    rope = RotaryEmbedding(config, spec.head_dim, spec.max_position_embeddings)

    def make() -> DecoderModel:
        layers = [MoeDecoderLayer(config, spec, i) for i in range(spec.num_layers)]
        return MoeDecoderModel(spec, layers, RMSNorm(spec.hidden_size, spec.rms_norm_eps),
                            {"rope": rope}, ["rope"] * spec.num_layers, cuda_graph_safe=experts_graph_safe)

    mixtral = config.architectures[0] == MIXTRAL

    def place(name: str, tensor: torch.Tensor, loader: WeightLoader) -> None:
        if mixtral:
            for old, new in _MIXTRAL_NAMES:
                name = name.replace(old, new)
        loader.copy_standard(name, tensor)

    return build_and_load(make, files, place, dtype, device)
