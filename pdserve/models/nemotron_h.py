"""Nemotron-H (NemotronHForCausalLM, model_type nemotron_h): a stack of single-mixer blocks, each
a pre-norm and a residual around one of Mamba2 (layers_block_type "linear_attention"), attention
("full_attention", without positional embedding: the Mamba layers carry position), or an MLP
("mlp", up and down projections with a squared-ReLU between), or a mixture of such MLPs ("moe",
pdserve.models.nemotron_h_moe).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.quant.unquantized import FloatLinear
from pdserve.models.decoder import build_and_load
from pdserve.models.hybrid import HybridAttention, HybridDecoderModel, kv_indices, state_indices
from pdserve.models.llama import Float32ScaleRMSNorm, ModelSpec
from pdserve.models.mamba2_mixer import Mamba2Mixer, Mamba2Shape, dt_lower_limit
from pdserve.models.nemotron_h_moe import NemotronHMoE, checkpoint_target
from pdserve.models.state_layers import state_dtype
from pdserve.models.weights import WeightLoader, check_fields

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
SUPPORTED_BLOCKS = (MAMBA, ATTENTION, MLP, MOE)


def check_config(config) -> None:
    check_fields(config, {"mlp_hidden_act": ("relu2",), "mamba_hidden_act": ("silu",), "sliding_window": (None,),
                          "attention_bias": (False,), "num_nextn_predict_layers": (0,), "moe_latent_size": (None,)})
    bad = set(config.layers_block_type) - set(SUPPORTED_BLOCKS)
    if bad:
        raise ValueError(f"layers_block_type {sorted(bad)} are not supported; supported: {', '.join(SUPPORTED_BLOCKS)}")
    if config.mamba_num_heads % config.n_groups:
        raise ValueError("mamba_num_heads must be a multiple of n_groups")
    state_dtype(config)  # refuses an unknown mamba_ssm_cache_dtype
    dt_lower_limit(config)  # refuses an upper limit of dt


class SquaredReluMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.up_proj = FloatLinear(hidden, intermediate, bias=bias)
        self.down_proj = FloatLinear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor, cos=None, sin=None, ctx=None) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class NemotronHBlock(nn.Module):
    def __init__(self, norm: nn.Module, mixer: nn.Module):
        super().__init__()
        self.norm, self.mixer = norm, mixer

    def forward(self, x: torch.Tensor, cos, sin, ctx) -> torch.Tensor:
        return x + self.mixer(self.norm(x), cos, sin, ctx)


def model_spec(config) -> ModelSpec:
    return ModelSpec(
        architecture=config.architectures[0], vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
        rms_norm_eps=config.layer_norm_epsilon, qkv_bias=False, o_bias=False, qk_norm=False,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings, hidden_act=config.mlp_hidden_act)


def mamba_shape(config) -> Mamba2Shape:
    return Mamba2Shape(config.hidden_size, config.mamba_num_heads, config.mamba_head_dim, config.n_groups,
                       config.ssm_state_size, config.conv_kernel, config.chunk_size, dt_lower_limit(config),
                       config.use_conv_bias, config.use_bias, config.layer_norm_epsilon)


def _mixer(config, spec: ModelSpec, kind: str, kv_index: int | None, state_index: int | None) -> nn.Module:
    if kind == MAMBA:
        return Mamba2Mixer(mamba_shape(config), state_index)
    if kind == ATTENTION:
        return HybridAttention(spec, kv_index)
    if kind == MOE:
        return NemotronHMoE(config, SquaredReluMLP(spec.hidden_size, config.moe_shared_expert_intermediate_size,
                                                   config.mlp_bias))
    return SquaredReluMLP(spec.hidden_size, spec.intermediate_size, config.mlp_bias)


def checkpoint_name(name: str) -> str | None:
    """The module's parameter name for a checkpoint tensor's (without 'model.'; NVIDIA's and
    transformers' own checkpoints name the stack 'backbone.'); None: skipped (multi-token-prediction
    layers)."""
    name = name.removeprefix("backbone.")
    if name.startswith("mtp."):
        return None
    if name.startswith("embeddings."):
        return "embed_tokens." + name.removeprefix("embeddings.")
    return "norm." + name.removeprefix("norm_f.") if name.startswith("norm_f.") else name


def build_model(config, files: list[Path], dtype: torch.dtype, device: torch.device) -> HybridDecoderModel:
    spec = model_spec(config)
    kinds = list(config.layers_block_type)
    kv, states = kv_indices(kinds, (ATTENTION,)), state_indices(kinds, (MAMBA,))

    def make() -> HybridDecoderModel:
        layers = [NemotronHBlock(Float32ScaleRMSNorm(spec.hidden_size, spec.rms_norm_eps), _mixer(config, spec, kind, kv[i], states[i]))
                  for i, kind in enumerate(kinds)]
        return HybridDecoderModel(spec, layers, Float32ScaleRMSNorm(spec.hidden_size, spec.rms_norm_eps), {}, [None] * len(kinds),
                                  state_dtype=state_dtype(config))

    def place(name: str, tensor: torch.Tensor, loader: WeightLoader) -> None:
        name = checkpoint_name(name)
        if name is None:
            return
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            loader.copy_standard(name, tensor)  # into the fused qkv_proj
        else:
            target, index = checkpoint_target(name)  # (an MLP's up_proj has no gate to fuse with)
            loader.copy(target, tensor, index)

    return build_and_load(make, files, place, dtype, device)
