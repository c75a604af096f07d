"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over pdserve's paged KV cache.

q/k/v and gate/up projections are fused into one matmul each: on CPU the cost is in matmul
calls, and one wide matmul beats three narrow ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.native_decode import DecodeLayer, DecodeWeights
from pdserve.kernels.native_matrices import bf16_matrix, float32_on_cpu, float_matrix
from pdserve.layers import bf16_rows
from pdserve.layers.bf16_mlp import gate_up_silu_down
from pdserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pdserve.layers.quant.unquantized import UnquantizedLinearMethod, bf16_tiles_of, exact_bf16_weight
from pdserve.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from pdserve.models.rope import RotaryEmbedding


@dataclass
class ModelSpec:
    """The architecture facts the engine needs, read from a Hugging Face config."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    hidden_act: str
    # Per layer: its sliding window in tokens, 0 for full attention (empty: no layer slides).
    layer_windows: tuple[int, ...] = ()


def layer_windows(config) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as transformers decides it: from
    layer_types where the config has them (Qwen2/Qwen3 derive them from use_sliding_window and
    max_window_layers), else sliding_window on every layer (Mistral, whose modeling code
    ignores layer_types)."""
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and getattr(config, "model_type", "") != "mistral":
        return tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    return (window,) * config.num_hidden_layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers: normalise in float32, scale in the input dtype.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Float32ScaleRMSNorm(RMSNorm):
    """RMSNorm that scales in float32, then casts (gpt-oss's and Nemotron-H's; Llama's casts, then
    scales)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class Attention(nn.Module):
    """Heads split over the TP group: each rank attends its own query heads and KV heads."""

    def __init__(self, spec: ModelSpec, layer_idx: int, quant_config=None):
        super().__init__()
        self.layer_idx = layer_idx
        prefix = f"layers.{layer_idx}.self_attn"
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads,
                                          bias=spec.qkv_bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size, self.kv_size = self.num_heads * spec.head_dim, self.num_kv_heads * spec.head_dim
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=spec.o_bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.scale = spec.head_dim ** -0.5
        self.window = spec.layer_windows[layer_idx] if spec.layer_windows else 0

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx, fused=None,
                low: bool = False) -> torch.Tensor:
        """low (layers/bf16_rows.py): x may be the norm's bf16 rows, and o's result stays bf16."""
        tokens = x.shape[0]
        qkv, roped = self._qkv(x, cos, sin, fused, low)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not roped and fused is not None:
            fused.rope_(q, k, cos, sin)  # in place: q, k are this step's own buffers
        elif not roped:
            q, k = RotaryEmbedding.apply(q, k, cos, sin)
        out = ctx.attention(self.layer_idx, q, k, v, self.scale, window=self.window).reshape(tokens, self.q_size)
        return bf16_rows.projection(self.o_proj, out, keep_bf16=True) if low else self.o_proj(out)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused, low: bool) -> tuple[torch.Tensor, bool]:
        """qkv_proj(x) float32, and whether q and k are rotated already: under bf16 rows (low) the
        product's bf16 result is widened and rotated in one pass where the fused ops take it."""
        if not low:
            return self.qkv_proj(x), False
        widen_rope = getattr(fused, "widen_rope", None)
        if widen_rope is None or self.q_norm is not None:
            return bf16_rows.projection(self.qkv_proj, x, keep_bf16=False), False
        qkv = bf16_rows.projection(self.qkv_proj, x, keep_bf16=True)
        if qkv.dtype == torch.bfloat16:
            roped = widen_rope(qkv, self.num_heads, self.num_kv_heads, cos, sin)
            if roped is not None:
                return roped, True
        return qkv.float(), False


class MLP(nn.Module):
    """Column-parallel gate/up, row-parallel down: one all-reduce per block."""

    def __init__(self, spec: ModelSpec, quant_config=None, prefix: str = "mlp"):
        super().__init__()
        if spec.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {spec.hidden_act!r} is not supported; supported: silu")
        self.gate_up_proj = MergedColumnParallelLinear(spec.hidden_size, [spec.intermediate_size] * 2,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.intermediate = self.gate_up_proj.output_sizes[0]
        self.down_proj = RowParallelLinear(spec.intermediate_size, spec.hidden_size,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_with(x, self._silu_mul)

    def forward_with(self, x: torch.Tensor, silu_mul, low: bool = False, keep_bf16: bool = False) -> torch.Tensor:
        """down(silu_mul(gate_up(x))), or under bf16 products at many rows bf16 from gate_up to
        down in one pass (layers/bf16_mlp.py). low (layers/bf16_rows.py): x may be the norm's bf16
        rows (widened back, exactly, where the pass declines), and down's result stays bf16 where
        keep_bf16."""
        out = gate_up_silu_down(self.gate_up_proj, self.down_proj, x, keep_bf16=low and keep_bf16)
        if out is not None:
            return out
        x = x.float() if low else x
        return self.down_proj(silu_mul(self.gate_up_proj(x)))

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, quant_config=None):
        super().__init__()
        self.self_attn = Attention(spec, layer_idx, quant_config)
        self.mlp = MLP(spec, quant_config, f"layers.{layer_idx}.mlp")
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """forward(token_ids [T], positions [T], ctx) -> final hidden states [T, hidden]."""

    # Mistral's and Qwen2/3's sliding windows are applied by the attention kernels (window=),
    # so the engine serves the model's whole context rather than capping prompts at the window.
    handles_sliding_window = True
    # pdserve.kernels.native_decode.NativeDecode on CPU when the layers fit it (set by the model
    # runner, see native_decode_weights): a decode step's layers in one compiled call. None: the
    # layers below.
    native_decode = None

    def __init__(self, spec: ModelSpec, rope: RotaryEmbedding, quant_config=None):
        super().__init__()
        self.spec = spec
        self.rope = rope
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, quant_config=quant_config)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, quant_config) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, quant_config=quant_config, prefix="lm_head")
        if spec.tie_word_embeddings:
            self.lm_head.tie_to(self.embed_tokens)
        # pdserve.kernels.triton_fused on CUDA (set by the model runner); None: plain torch.
        self.fused = None

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, ctx, images=None) -> torch.Tensor:
        """images: a multimodal model's image embeddings for this step's placeholder rows
        (pdserve.engine.multimodal.ImageRows); they replace those rows' token embeddings."""
        x = self.embed_tokens(token_ids)
        if images is not None:
            x = images.merge(x)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        if self.native_decode is not None and self.native_decode.takes(x, ctx):
            return self.native_decode.forward(x, cos, sin, ctx)
        if self.fused is not None:
            return self._forward_fused(x, cos, sin, ctx)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)

    def _forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        """The same layers as forward, through fused kernels: each residual add is done by the
        norm that follows it, RoPE in place, SiLU * up in one pass."""
        f = self.fused
        low = self._plain_layers() and bf16_rows.step_takes(self.layers, x, f)  # bf16 between norms and products
        norm = f.rms_norm_low if low else f.rms_norm
        norms_after = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        first = self.layers[0].input_layernorm
        x, h = norm(x, first.weight, first.eps)
        for layer, next_norm in zip(self.layers, norms_after):
            attn = layer.self_attn(h, cos, sin, ctx, fused=f, low=low)
            post = layer.post_attention_layernorm
            x, h = norm(x, post.weight, post.eps, delta=attn)
            last = next_norm is self.norm  # the final norm's rows stay float32, for the LM head
            mlp = layer.mlp.forward_with(h, f.silu_mul, low=low, keep_bf16=not last)
            x, h = (f.rms_norm if last else norm)(x, next_norm.weight, next_norm.eps, delta=mlp)
        return h

    def _plain_layers(self) -> bool:
        return all(type(layer) is DecoderLayer and type(layer.self_attn) is Attention and type(layer.mlp) is MLP
                   for layer in self.layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def native_decode_weights(self) -> DecodeWeights | str:
        """This model's arrays for the compiled decode step (pdserve.kernels.native_decode), or
        why it cannot take them: only the Llama layers (with Qwen2's qkv bias, Qwen3's QK norms
        and LoRA slots), every matrix in a layout the compiled gemv takes, float32 norms on CPU."""
        if type(self) is not LlamaModel:
            return f"{type(self).__name__} is not the plain Llama model"
        if not self._plain_layers():
            return "the layers are not plain Llama layers"
        layers = [_native_layer(layer) for layer in self.layers]
        if any(layer is None for layer in layers):
            return "a linear layer is neither quantized for the compiled gemv nor float32 on CPU, or has a bias other than qkv's"
        if any(layer.self_attn.q_norm is not None and layer.self_attn.q_norm.eps != self.norm.eps
               for layer in self.layers):
            return "the QK norms' eps differs from the layer norms'"
        reason = next(filter(None, (layer.unfit() for layer in layers)), None)
        if reason is not None or not float32_on_cpu(self.norm.weight):
            return reason or "the final norm's weight is not float32 on CPU"
        attn = self.layers[0].self_attn
        group = attn.o_proj.tp  # at TP > 1 the o and down products' partial sums are all-reduced
        return DecodeWeights(layers, self.norm.weight, self.spec.hidden_size, self.layers[0].mlp.intermediate,
                             attn.num_heads, attn.num_kv_heads, attn.head_dim, self.norm.eps, attn.scale,
                             group if group.size > 1 else None)


def _native_matrix(linear, bias_ok: bool = False) -> tuple | None:
    """The compiled gemv's arguments for a linear layer (a rank's shard at TP > 1: a row-parallel
    layer's partial sums are all-reduced by the step): its packed quantized matrix, or its float32
    weight as it is; None where the gemv cannot take it."""
    if (linear.bias is not None and not bias_ok) or (
            linear.tp.size > 1 and getattr(linear, "reduce_results", True) is False):
        return None
    packed = getattr(linear.quant_method, "packed", None)
    if packed is not None:
        return packed(linear).native
    if isinstance(linear.quant_method, UnquantizedLinearMethod):  # bf16 rows where exact: half the bytes
        rows, tiles = exact_bf16_weight(linear), bf16_tiles_of(linear)  # (tiles: AMX's layout, made once)
        return bf16_matrix(rows, tiles) if rows is not None else float_matrix(linear.weight, tiles)
    return None


def _native_layer(layer: DecoderLayer) -> DecodeLayer | None:
    attn, mlp = layer.self_attn, layer.mlp
    matrices = [_native_matrix(attn.qkv_proj, bias_ok=True)]
    matrices += [_native_matrix(m) for m in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(m is None for m in matrices):
        return None
    qk_norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    loras = tuple(m.lora for m in linears) if any(m.lora is not None for m in linears) else None
    return DecodeLayer(*matrices, layer.input_layernorm.weight, layer.post_attention_layernorm.weight, attn.window,
                       attn.qkv_proj.bias, *qk_norms, loras)
