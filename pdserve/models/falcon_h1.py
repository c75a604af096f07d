"""Falcon-H1 (FalconH1ForCausalLM, model_type falcon_h1): every layer runs a Mamba2 mixer and
attention side by side on the same normed input, adds their outputs to the residual, then a
SwiGLU MLP. So each layer holds both a plane in the KV cache and a state slot (its
layers_block_type is "hybrid" throughout: pdserve.protocol.block_keys counts it as both).

What differs from Granite 4.0-H's Mamba2 and attention: Falcon's muP multipliers, each where
transformers applies it, never folded into the weights (folding would round differently):
- the embedding times embedding_multiplier, the logits times lm_head_multiplier;
- the Mamba input times ssm_in_multiplier, its projection times a per-section vector
  (ssm_multipliers over z | x | B | C | dt), its output times ssm_out_multiplier;
- the attention input times attention_in_multiplier, the keys times key_multiplier, the output
  times attention_out_multiplier;
- the MLP's gate times mlp_multipliers[0] before the SiLU, its output times mlp_multipliers[1].
The Mamba output is gated by SiLU(z), through a grouped RMSNorm only with mamba_rms_norm (then
normed before or after the gate, as mamba_norm_before_gate says).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.quant.unquantized import FloatLinear
from pdserve.models.decoder import build_and_load
from pdserve.models.hybrid import HybridAttention, HybridDecoderModel
from pdserve.models.llama import ModelSpec, RMSNorm
from pdserve.models.mamba2_mixer import Mamba2Mixer, Mamba2Shape, dt_lower_limit
from pdserve.models.rope import RotaryEmbedding
from pdserve.models.state_layers import state_dtype
from pdserve.models.weights import WeightLoader, check_fields

# checkpoint name part -> this module's (q/k/v and gate/up then fuse through copy_standard)
_NAMES = ((".mamba.", ".mixer."), (".feed_forward.", ".mlp."), ("final_layernorm.", "norm."))


def check_config(config) -> None:
    check_fields(config, {"hidden_act": ("silu",), "mamba_proj_bias": (False,), "projectors_bias": (False,)})
    dt_lower_limit(config)  # refuses an upper limit of dt
    if config.mamba_n_heads % config.mamba_n_groups:
        raise ValueError("mamba_n_heads must be a multiple of mamba_n_groups")
    state_dtype(config)  # refuses an unknown mamba_ssm_cache_dtype


class FalconGatedNorm(nn.Module):
    """transformers' FalconH1RMSNormGated: RMS-normalised within each of `groups` groups, times w,
    and times SiLU(gate) after (norm_before_gate) or before the norm."""

    def __init__(self, dim: int, groups: int, eps: float, norm_before_gate: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps, self.norm_before_gate = groups, eps, norm_before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if not self.norm_before_gate:
            x = x * F.silu(gate.float())
        h = x.float().view(*x.shape[:-1], self.groups, -1)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = (self.weight.view(self.groups, -1) * h).view(x.shape)
        if self.norm_before_gate:
            h = h * F.silu(gate.float())
        return h.to(dtype)


def mup_vector(config, inner: int) -> torch.Tensor:
    """The per-column multipliers of the Mamba projection [z | x | B | C | dt] (ssm_multipliers)."""
    bc = config.mamba_n_groups * config.mamba_d_state
    sizes = (inner, inner, bc, bc, config.mamba_n_heads)
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, config.ssm_multipliers)])


class FalconMamba2Mixer(Mamba2Mixer):
    def __init__(self, config, shape: Mamba2Shape, state_index: int):
        super().__init__(shape, state_index)
        self.in_multiplier = config.ssm_in_multiplier
        self.mup: torch.Tensor | None = None  # set after loading (the model is built on meta)
        self.norm = (FalconGatedNorm(self.inner, self.groups, shape.eps, config.mamba_norm_before_gate)
                     if config.mamba_rms_norm else None)

    def forward(self, x: torch.Tensor, cos, sin, ctx) -> torch.Tensor:
        tokens = x.shape[0]
        projected = self.in_proj(x * self.in_multiplier) * self.mup
        gate, xbc, dt = projected.split([self.inner, self.conv_size, self.heads], dim=-1)
        xbc = F.silu(self._convolve(xbc, ctx.states))
        xs, B, C = xbc.split([self.inner, self.groups * self.state_size, self.groups * self.state_size], dim=-1)
        y = self._scan(xs.reshape(tokens, self.heads, self.head_dim), F.softplus(dt + self.dt_bias),
                       B.reshape(tokens, self.groups, self.state_size),
                       C.reshape(tokens, self.groups, self.state_size), ctx.states).reshape(tokens, self.inner)
        y = self.norm(y, gate) if self.norm is not None else y * F.silu(gate)
        return self.out_proj(y.to(x.dtype))


class FalconAttention(HybridAttention):
    """HybridAttention with Falcon's key multiplier (on the keys before RoPE, as transformers)."""

    def __init__(self, spec: ModelSpec, kv_index: int, key_multiplier: float, bias: bool):
        super().__init__(spec, kv_index, bias=bias)
        self.key_multiplier = key_multiplier

    def forward(self, x: torch.Tensor, cos, sin, ctx) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = (k * self.key_multiplier).reshape(tokens, self.num_kv_heads, self.head_dim)
        q, k = RotaryEmbedding.apply(q, k, cos, sin)
        out = ctx.attention(self.kv_index, q, k, v.reshape(tokens, self.num_kv_heads, self.head_dim), self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class FalconMLP(nn.Module):
    """SwiGLU with gate and up fused, the gate scaled before SiLU and the output after."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, multipliers: list[float]):
        super().__init__()
        self.gate_up_proj = FloatLinear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = FloatLinear(intermediate, hidden, bias=bias)
        self.gate_multiplier, self.down_multiplier = multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate * self.gate_multiplier)) * self.down_multiplier


class FalconH1Layer(nn.Module):
    def __init__(self, config, spec: ModelSpec, index: int):
        super().__init__()
        self.mixer = FalconMamba2Mixer(config, mamba_shape(config), index)  # `mixer`: the state's owner
        self.self_attn = FalconAttention(spec, index, config.key_multiplier, config.attention_bias)
        self.mlp = FalconMLP(spec.hidden_size, spec.intermediate_size, config.mlp_bias, config.mlp_multipliers)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.ssm_out = config.ssm_out_multiplier
        self.attn_in, self.attn_out = config.attention_in_multiplier, config.attention_out_multiplier

    def forward(self, x: torch.Tensor, cos, sin, ctx) -> torch.Tensor:
        h = self.input_layernorm(x)
        mixed = self.mixer(h, cos, sin, ctx) * self.ssm_out
        attended = self.self_attn(h * self.attn_in, cos, sin, ctx) * self.attn_out
        x = x + (mixed + attended)
        return x + self.mlp(self.pre_ff_layernorm(x))


class FalconH1Model(HybridDecoderModel):
    def __init__(self, *args, lm_head_multiplier: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.lm_head_multiplier = lm_head_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lm_head(hidden) * self.lm_head_multiplier).float()


def model_spec(config) -> ModelSpec:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelSpec(
        architecture=config.architectures[0], vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
        qk_norm=False, tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=config.max_position_embeddings, hidden_act=config.hidden_act)


def mamba_shape(config) -> Mamba2Shape:
    return Mamba2Shape(config.hidden_size, config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups,
                       config.mamba_d_state, config.mamba_d_conv, config.mamba_chunk_size, dt_lower_limit(config),
                       config.mamba_conv_bias, config.mamba_proj_bias, config.rms_norm_eps)


def build_model(config, files: list[Path], dtype: torch.dtype, device: torch.device) -> HybridDecoderModel:
    spec = model_spec(config)
    rope = RotaryEmbedding(config, spec.head_dim, spec.max_position_embeddings)

    def make() -> HybridDecoderModel:
        layers = [FalconH1Layer(config, spec, i) for i in range(spec.num_layers)]
        return FalconH1Model(spec, layers, RMSNorm(spec.hidden_size, spec.rms_norm_eps), {"rope": rope},
                             ["rope"] * spec.num_layers, embed_scale=config.embedding_multiplier,
                             lm_head_multiplier=config.lm_head_multiplier, state_dtype=state_dtype(config))

    def place(name: str, tensor: torch.Tensor, loader: WeightLoader) -> None:
        for old, new in _NAMES:
            name = name.replace(old, new)
        loader.copy_standard(name, tensor)

    model = build_and_load(make, files, place, dtype, device)
    for layer in model.layers:  # float32, as transformers' buffer (a product with it promotes)
        layer.mixer.mup = mup_vector(config, layer.mixer.inner).to(device)
    return model
