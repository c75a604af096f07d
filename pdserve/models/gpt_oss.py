"""gpt-oss over the paged KV cache.

Its attention alternates sliding-window and full layers (layer_types), every layer has learned
attention sinks (one logit per head in the softmax's denominator), q/k/v/o have biases and RoPE
is yarn-scaled. Its MoE routes by the top-k router logits (router with a bias), softmaxed over
those k, and each expert is a biased, clamped SwiGLU: gate clamped above at `limit`, up to
[-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate).

An MXFP4 checkpoint (quant_method mxfp4, as gpt-oss ships) keeps its experts packed
(pdserve.layers.quant.mxfp4; on CUDA a grouped Triton GEMM, pdserve.models.moe_quant). The
checkpoint stores the experts as gate_up_proj [E, H, 2I] with gate and up interleaved along the
last dim, and down_proj [E, I, H]; they are loaded into the [E, 2I, H] gate-first
layout of pdserve.models.moe.Experts.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from pdserve.layers.quant import mxfp4
from pdserve.layers.quant.base import quantization_dict
from pdserve.models.attention import PagedAttention
from pdserve.models.decoder import DecoderModel, build_and_load
from pdserve.models.llama import Float32ScaleRMSNorm, ModelSpec
from pdserve.models.moe import SparseMoE, clamped_swiglu, experts_graph_safe, topk_softmax
from pdserve.models.moe_decoder import MoeDecoderModel
from pdserve.models.moe_quant import Mxfp4Experts
from pdserve.models.rope import RotaryEmbedding, rope_type_of
from pdserve.models.weights import WeightLoader, check_fields

LAYER_TYPES = ("sliding_attention", "full_attention")
LOADS_QUANTIZED = True  # check_config vets the quantization_config (pdserve.models.loader)


def swiglu_params(config) -> dict[str, float]:
    """clamped_swiglu's alpha (the gate's sigmoid slope) and limit: config fields in recent
    transformers, gpt-oss's constants (1.702, 7.0) in older ones, whose configs lack them (5.17)."""
    return {"alpha": getattr(config, "swiglu_alpha", 1.702), "limit": getattr(config, "swiglu_limit", 7.0)}


def check_config(config) -> None:
    if (quantization := quantization_dict(config)) is not None:
        mxfp4.check_config(quantization)
    check_fields(config, {"attention_bias": (True, False), "tie_word_embeddings": (False, True)})
    bad = set(config.layer_types) - set(LAYER_TYPES)
    if bad:
        raise ValueError(f"layer_types {sorted(bad)} are not supported; supported: {', '.join(LAYER_TYPES)}")
    if rope_type_of(config) not in ("default", "yarn"):
        raise ValueError(f"rope type {rope_type_of(config)!r} is not supported for gpt-oss; supported: yarn, default")
    if config.num_experts_per_tok > config.num_local_experts:
        raise ValueError(f"num_experts_per_tok {config.num_experts_per_tok} exceeds the "
                         f"{config.num_local_experts} experts")


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config, spec: ModelSpec, layer: int):
        super().__init__()
        sliding = config.layer_types[layer] == "sliding_attention"
        self.self_attn = PagedAttention(
            spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, layer,
            qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, sinks=True,
            window=config.sliding_window if sliding else 0)
        self.mlp = SparseMoE(
            spec.hidden_size, config.intermediate_size, config.num_local_experts,
            functools.partial(topk_softmax, top_k=config.num_experts_per_tok),
            router_bias=True, expert_bias=True,
            activation=functools.partial(clamped_swiglu, **swiglu_params(config)))
        self.input_layernorm = Float32ScaleRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = Float32ScaleRMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


def model_spec(config) -> ModelSpec:
    bias = bool(config.attention_bias)
    return ModelSpec(
        architecture=config.architectures[0], vocab_size=config.vocab_size,
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps, qkv_bias=bias, o_bias=bias, qk_norm=False,
        tie_word_embeddings=bool(config.tie_word_embeddings),
        max_position_embeddings=config.max_position_embeddings, hidden_act="clamped_swiglu")


def _place(name: str, tensor: torch.Tensor, loader: WeightLoader) -> None:
    """The checkpoint's router and interleaved, transposed experts into SparseMoE's layout."""
    name = name.replace(".mlp.router.", ".mlp.gate.")
    if ".mlp.experts." not in name:
        loader.copy_standard(name, tensor)
        return
    base, _, part = name.rpartition(".")
    packed = mxfp4.packed_expert_part(part, tensor)
    if packed is not None:
        loader.copy(f"{base}.{packed[0]}", packed[1])
        return
    if part == "gate_up_proj":  # [E, H, 2I], gate/up interleaved -> [E, 2I, H], gate rows first
        tensor = torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1).transpose(1, 2)
    elif part == "gate_up_proj_bias":
        part, tensor = "gate_up_bias", torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1)
    elif part == "down_proj":  # [E, I, H] -> [E, H, I]
        tensor = tensor.transpose(1, 2)
    elif part == "down_proj_bias":
        part = "down_bias"
    loader.copy(f"{base}.{part}", tensor.contiguous())


def build_model(config, files: list[Path], dtype: torch.dtype, device: torch.device) -> DecoderModel:
    spec = model_spec(config)
    rope = RotaryEmbedding(config, spec.head_dim, spec.max_position_embeddings)

    quantized = quantization_dict(config) is not None

    def make() -> DecoderModel:
        layers = [GptOssDecoderLayer(config, spec, i) for i in range(spec.num_layers)]
        for layer in layers if quantized else ():
            layer.mlp.experts = Mxfp4Experts.like(layer.mlp.experts)
        return MoeDecoderModel(spec, layers, Float32ScaleRMSNorm(spec.hidden_size, spec.rms_norm_eps), {"rope": rope},
                            ["rope"] * spec.num_layers, cuda_graph_safe=experts_graph_safe)

    return build_and_load(make, files, _place, dtype, device)
