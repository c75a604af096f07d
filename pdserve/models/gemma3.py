"""Gemma 3 (text only, gemma3_text) over the paged KV cache.

What differs from Llama: the embedding is scaled by sqrt(hidden); RMSNorm scales by (1 + w);
each layer norms its attention and MLP outputs too (post norms) besides their inputs; q and k
get an RMSNorm per head; scores are scaled by query_pre_attn_scalar**-0.5; the MLP is
gelu(tanh)-gated; sliding and full layers (layer_types) each have their own RoPE
(rope_parameters per layer type; rope_local_base_freq in older configs); the final logits may
be soft-capped.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.native_decode import DecodeLayer, DecodeWeights
from pdserve.kernels.native_matrices import float_matrix
from pdserve.models.attention import PagedAttention, RopeTable
from pdserve.models.decoder import DecoderModel, build_and_load, summing_group
from pdserve.models.llama import ModelSpec
from pdserve.models.moe import DenseMLP
from pdserve.models.rope import SUPPORTED_ROPE_TYPES
from pdserve.models.weights import WeightLoader, check_fields

LAYER_TYPES = ("sliding_attention", "full_attention")


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def check_config(config) -> None:
    check_fields(config, {"hidden_activation": ("gelu_pytorch_tanh",), "attn_logit_softcapping": (None,),
                          "use_bidirectional_attention": (False,), "attention_bias": (False, True)})
    bad = set(config.layer_types) - set(LAYER_TYPES)
    if bad:
        raise ValueError(f"layer_types {sorted(bad)} are not supported; supported: {', '.join(LAYER_TYPES)}")
    for layer_type in set(config.layer_types):
        rope_type = _rope_params(config, layer_type).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"{layer_type} rope type {rope_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _rope_params(config, layer_type: str) -> dict:
    return (config.rope_parameters or {}).get(layer_type) or {}


def _rope(config, layer_type: str, head_dim: int) -> RopeTable:
    """The layer type's RoPE table, with transformers' own frequency init for scaled types."""
    params = _rope_params(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq, scaling = 1.0 / (params["rope_theta"] ** exps), 1.0
    else:
        # deferred: transformers takes ~1 s to import; only scaled RoPE types need it
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), layer_type=layer_type)
    return RopeTable(inv_freq, scaling, config.max_position_embeddings)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, spec: ModelSpec, layer: int):
        super().__init__()
        norm = functools.partial(GemmaRMSNorm, eps=spec.rms_norm_eps)
        sliding = config.layer_types[layer] == "sliding_attention"
        self.self_attn = PagedAttention(
            spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, layer,
            qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, scale=config.query_pre_attn_scalar ** -0.5,
            window=config.sliding_window if sliding else 0, qk_norm=norm)
        self.mlp = DenseMLP(spec.hidden_size, spec.intermediate_size, activation=gelu_tanh_mul)
        self.input_layernorm = norm(spec.hidden_size)
        self.post_attention_layernorm = norm(spec.hidden_size)
        self.pre_feedforward_layernorm = norm(spec.hidden_size)
        self.post_feedforward_layernorm = norm(spec.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(DecoderModel):
    """Gemma 3's decoder, whose float32 decode steps on CPU take the compiled step."""

    def native_decode_weights(self) -> DecodeWeights | str:
        """The arrays of the compiled decode step (pdserve.kernels.native_decode), or why it cannot
        take them: float32 weights on CPU without biases, the norms' (1 + w) added here."""
        group = summing_group(self)  # at TP > 1, the rank group the C step sums the outputs with
        if isinstance(group, str):
            return group
        names = sorted(self.ropes)
        layers = [_native_layer(layer, names.index(rope)) for layer, rope in zip(self.layers, self.layer_rope)]
        reason = next((r for r in layers if isinstance(r, str)), None)
        if reason is None:
            reason = next(filter(None, (layer.unfit() for layer in layers)), None)
        if reason is not None:
            return reason
        attn, mlp, norm = self.layers[0].self_attn, self.layers[0].mlp, self.norm
        return DecodeWeights(layers, _plus_one(norm), self.spec.hidden_size, mlp.down_proj.weight.shape[1],
                             attn.num_heads, attn.num_kv_heads, attn.head_dim, norm.eps, attn.scale,
                             tp_group=group, activation="gelu_tanh")


def _plus_one(norm: GemmaRMSNorm) -> torch.Tensor:
    """The weight GemmaRMSNorm multiplies by, 1 + w, in float32 as it computes it."""
    return (1.0 + norm.weight.float()).contiguous()


def _native_layer(layer: Gemma3DecoderLayer, rope: int) -> DecodeLayer | str:
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if attn.sinks is not None or any(m.bias is not None for m in linears[1:]):
        return "a bias past qkv's, or attention sinks"
    matrices = [float_matrix(m.weight) for m in linears]  # (DecodeLayer.unfit checks the qkv bias)
    if any(m is None for m in matrices):
        return "a weight is not float32 on CPU, or its rows are not whole blocks of 32 columns"
    if len({n.eps for n in (layer.input_layernorm, attn.q_norm, layer.post_feedforward_layernorm)}) > 1:
        return "the norms' eps differ"
    return DecodeLayer(*matrices, _plus_one(layer.input_layernorm), _plus_one(layer.pre_feedforward_layernorm),
                       attn.window, attn.qkv_proj.bias, _plus_one(attn.q_norm), _plus_one(attn.k_norm),
                       attn_out_norm=_plus_one(layer.post_attention_layernorm),
                       mlp_out_norm=_plus_one(layer.post_feedforward_layernorm), rope=rope)


def model_spec(config) -> ModelSpec:
    bias = bool(config.attention_bias)
    return ModelSpec(
        architecture=config.architectures[0], vocab_size=config.vocab_size,
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps, qkv_bias=bias, o_bias=bias, qk_norm=True,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        max_position_embeddings=config.max_position_embeddings, hidden_act=config.hidden_activation)


def build_model(config, files: list[Path], dtype: torch.dtype, device: torch.device, *,
                model_class: type[DecoderModel] = Gemma3Model,
                rename: Callable[[str], str | None] | None = None) -> DecoderModel:
    """model_class and rename: a vision-language checkpoint's language model (gemma3_vl), whose
    tensors carry a prefix, beside the tower's (rename gives None for those: skipped)."""
    spec = model_spec(config)
    ropes = {t: _rope(config, t, spec.head_dim) for t in sorted(set(config.layer_types))}

    def make() -> DecoderModel:
        layers = [Gemma3DecoderLayer(config, spec, i) for i in range(spec.num_layers)]
        return model_class(spec, layers, GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps), ropes,
                           list(config.layer_types), embed_scale=spec.hidden_size ** 0.5,
                           final_softcap=config.final_logit_softcapping)

    def place(name: str, tensor: torch.Tensor, loader: WeightLoader) -> None:
        name = rename(name) if rename is not None else name
        if name is None or (name == "lm_head.weight" and spec.tie_word_embeddings):
            return
        loader.copy_standard(name, tensor)

    return build_and_load(make, files, place, dtype, device)
