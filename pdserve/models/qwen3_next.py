"""Qwen3-Next (Qwen3NextForCausalLM, model_type qwen3_next): Qwen3.5's hybrid stack (Gated
DeltaNet layers beside gated, partially rotary attention; pdserve.models.qwen3_5) with MoE MLPs.

What differs from Qwen3.5: the linear layers' projections are fused and grouped by key head
(pdserve.models.gated_deltanet.GroupedGatedDeltaNet); the MLPs are MoE blocks (softmax top-k,
renormalised when norm_topk_prob, plus a shared expert behind its sigmoid gate, as Qwen2-MoE's)
except in mlp_only_layers and off decoder_sparse_step, which have a dense MLP.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from pdserve.layers.quant.unquantized import FloatLinear
from pdserve.models import qwen3_5
from pdserve.models.decoder import build_and_load
from pdserve.models.gated_deltanet import GroupedGatedDeltaNet
from pdserve.models.gemma3 import GemmaRMSNorm
from pdserve.models.hybrid import HybridDecoderModel, kv_indices, state_indices
from pdserve.models.llama import ModelSpec
from pdserve.models.moe import DenseMLP, SparseMoE, softmax_topk
from pdserve.models.rope import RotaryEmbedding
from pdserve.models.weights import WeightLoader

LINEAR, FULL = qwen3_5.LINEAR, qwen3_5.FULL


def check_config(config) -> None:
    qwen3_5.check_config(config)
    if config.num_experts and config.num_experts < config.num_experts_per_tok:
        raise ValueError(f"num_experts_per_tok {config.num_experts_per_tok} exceeds the {config.num_experts} experts")


def _is_sparse(config, layer: int) -> bool:
    return (layer not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (layer + 1) % config.decoder_sparse_step == 0)


def _mlp(config, spec: ModelSpec, layer: int) -> nn.Module:
    if not _is_sparse(config, layer):
        return DenseMLP(spec.hidden_size, config.intermediate_size, linear=FloatLinear)
    route = functools.partial(softmax_topk, top_k=config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob))
    return SparseMoE(spec.hidden_size, config.moe_intermediate_size, config.num_experts, route,
                     shared_intermediate=config.shared_expert_intermediate_size, shared_gate=True)


def build_model(config, files: list[Path], dtype: torch.dtype, device: torch.device) -> HybridDecoderModel:
    spec = qwen3_5.model_spec(config)
    partial = (config.rope_parameters or {}).get("partial_rotary_factor", 1.0)
    rotary_dim = int(spec.head_dim * partial)
    rope = RotaryEmbedding(config, rotary_dim, spec.max_position_embeddings)
    kv = kv_indices(config.layer_types, (FULL,))
    states = state_indices(config.layer_types, (LINEAR,))

    def mixer(i: int) -> nn.Module:
        if states[i] is not None:
            return GroupedGatedDeltaNet(config, states[i])
        return qwen3_5.GatedAttention(spec, kv[i], rotary_dim)

    def make() -> HybridDecoderModel:
        layers = [qwen3_5.Qwen35DecoderLayer(config, spec, mixer(i), _mlp(config, spec, i))
                  for i in range(spec.num_layers)]
        return HybridDecoderModel(spec, layers, GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps),
                                  {"rope": rope}, ["rope"] * spec.num_layers)

    def place(name: str, tensor: torch.Tensor, loader: WeightLoader) -> None:
        name = qwen3_5.checkpoint_name(name)
        if name is not None:
            loader.copy_standard(name, tensor)

    return build_and_load(make, files, place, dtype, device)
