"""What the hybrid families (Qwen3.5, Nemotron-H) share: a decoder whose layers mix tokens by
attention over the paged KV cache or by a recurrent state (linear attention, Mamba2) kept in a
per-request slot, and the refusals of what pdserve does not yet do for them.

The engine reads `state_spec()` to size the state pool; attention layers are numbered among
themselves (`kv_index`), since only they have a plane in the KV cache
(pdserve.protocol.block_keys.kv_layer_count).
"""
from __future__ import annotations

import torch
from torch import nn

from pdserve.layers.quant.unquantized import FloatLinear, FloatLMHead
from pdserve.models.decoder import DecoderModel
from pdserve.models.llama import ModelSpec
from pdserve.models.rope import RotaryEmbedding
from pdserve.models.state_layers import LayerStateSpec
from pdserve.protocol.block_keys import has_state_layers


def is_hybrid_config(hf_config) -> bool:
    """The config names layers that keep a recurrent state (linear attention, Mamba)."""
    return has_state_layers(hf_config)


class HybridDecoderModel(DecoderModel):
    """A DecoderModel with stateful layers: each layer's token mixer (`mixer`) may declare
    `state_spec(dtype, state_dtype)`. Runs its layers in Python (no compiled decode step, no
    CUDA graphs: the state update is not captured)."""

    is_hybrid = True

    def __init__(self, *args, state_dtype: torch.dtype = torch.float32, **kwargs):
        super().__init__(*args, cuda_graph_safe=False, **kwargs)
        self.state_dtype = state_dtype
        # the LM head's products follow cpu_gemm_dtype as the layers' do (a 32-row decode step's
        # float32 product over a vocab of 8,192 was 2 of a Qwen3.5-shaped step's 13.5 ms), with
        # float32 sums, as the Llama family's head (FloatLMHead)
        self.lm_head = FloatLMHead(self.spec.hidden_size, self.spec.vocab_size, bias=False)

    def state_spec(self) -> list[LayerStateSpec]:
        """Per stateful layer, in state_index order: its window's and its state's shapes and dtypes."""
        dtype = self.embed_tokens.weight.dtype
        return [layer.mixer.state_spec(dtype, self.state_dtype) for layer in self.layers
                if hasattr(layer.mixer, "state_spec")]


class HybridAttention(nn.Module):
    """Plain causal attention over the paged KV cache beside the stateful layers (Nemotron-H,
    Granite 4.0-H): fused q/k/v, RoPE only where the model has it (cos None: none; the Mamba
    layers carry position), a given score scale."""

    def __init__(self, spec: ModelSpec, kv_index: int, scale: float | None = None, bias: bool = False):
        super().__init__()
        self.kv_index = kv_index
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = FloatLinear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = FloatLinear(self.q_size, spec.hidden_size, bias=bias)
        self.scale = spec.head_dim ** -0.5 if scale is None else scale

    def shard_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def forward(self, x: torch.Tensor, cos, sin, ctx) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        if cos is not None:
            q, k = RotaryEmbedding.apply(q, k, cos, sin)
        out = ctx.attention(self.kv_index, q, k, v.reshape(tokens, self.num_kv_heads, self.head_dim), self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


def kv_indices(layer_types: list[str], attention: tuple[str, ...]) -> list[int | None]:
    """Each layer's plane in the KV cache (attention layers, numbered in order) or None."""
    out, n = [], 0
    for t in layer_types:
        out.append(n if t in attention else None)
        n += t in attention
    return out


def state_indices(layer_types: list[str], stateful: tuple[str, ...]) -> list[int | None]:
    """Each layer's slot in a request's state (stateful layers, numbered in order) or None."""
    return kv_indices(layer_types, stateful)


def unsupported_for_hybrid(config, architecture: str, tp_families: tuple[str, ...]) -> list[str]:
    """The engine settings pdserve does not implement for hybrid models yet, each with why; empty:
    the config can run. tp_families: the hybrid architectures tensor parallelism splits.
    (Checked at start-up by pdserve.assembly.)"""
    refused = []
    if config.speculative_config is not None:
        refused.append("speculative decoding (speculative_config): rejected drafts would need the recurrent "
                       "state rolled back")
    if config.enable_lora:
        refused.append("LoRA adapters (enable_lora, lora_modules): the linear-attention and Mamba layers take none")
    if config.pipeline_parallel_size > 1:
        refused.append("pipeline parallelism (pipeline_parallel_size)")
    if config.tensor_parallel_size > 1 and architecture not in tp_families:
        refused.append(f"tensor parallelism (tensor_parallel_size) for {architecture}: only the text models "
                       f"({', '.join(tp_families)}) are split so far")
    return refused
