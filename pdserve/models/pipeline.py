"""A model cut to one pipeline stage: its range of decoder layers, the embedding on the first
stage, the final norm and LM head on the last (pdserve.executor runs the stages).

The cut works on any family whose forward is embedding -> layers -> norm (Llama, the MoE
families, DeepSeek): the layers list keeps its length, with the other stages' layers replaced
by pass-through placeholders (so layer indices, each layer's RoPE choice and its KV cache slot
are unchanged), and a later stage's embedding is replaced by the hidden states the stage before
sent. The residual stream is the hidden state itself in these layers (each layer returns x +
attention + MLP), so nothing else crosses a stage boundary.
"""
from __future__ import annotations

import functools

import torch
from torch import nn


def pp_layer_range(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    """[start, end) of the layers stage `stage` holds, as vLLM's get_pp_indices splits them: by
    count, the remainder going one each to the stages before the last (the last one also
    carries the norm and the LM head)."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is not one of {num_stages}")
    if num_layers < num_stages:
        raise ValueError(f"pipeline_parallel_size={num_stages} exceeds the model's {num_layers} layers")
    sizes = [num_layers // num_stages] * num_stages
    for i in range(2, num_layers % num_stages + 2):
        sizes[-i] += 1
    start = sum(sizes[:stage])
    return start, start + sizes[stage]


class StageInput(nn.Module):
    """Stands in for the embedding on a later stage: returns the hidden states the stage before
    sent for this step (set just before the forward pass)."""

    def __init__(self):
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        hidden, self.hidden = self.hidden, None
        if hidden is None or hidden.shape[0] != token_ids.shape[0]:
            raise RuntimeError("a later pipeline stage ran without its step's hidden states")
        return hidden


class _Window(nn.Module):
    def __init__(self, window: int):
        super().__init__()
        self.window = window


class MissingLayer(nn.Module):
    """Another stage's layer: passes the hidden states through. It keeps the layer's attention
    window, which the engine reads to know how far back a request's blocks are needed."""

    def __init__(self, window: int):
        super().__init__()
        self.self_attn = _Window(window)

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        return x


def cut_to_stage(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """Drop what stage `stage` of num_stages does not run (its weights are freed); returns model."""
    start, end = pp_layer_range(len(model.layers), stage, num_stages)
    for i, layer in enumerate(model.layers):
        if not start <= i < end:
            window = getattr(getattr(layer, "self_attn", None), "window", 0) or 0
            model.layers[i] = MissingLayer(window)
    model.pp_layers = (start, end)
    if stage > 0:
        model.embed_tokens = StageInput()
        if getattr(model, "embed_scale", None) is not None:
            model.embed_scale = None  # applied once, on the first stage
    if stage < num_stages - 1:
        model.norm = nn.Identity()
        model.lm_head = None
    if hasattr(model, "_forward_fused"):  # the Llama family's fused-kernel path (numba on CPU)
        model._forward_fused = functools.partial(_stage_forward_fused, model, stage == num_stages - 1)
    return model


def _stage_forward_fused(model: nn.Module, last: bool, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         ctx) -> torch.Tensor:
    """LlamaModel._forward_fused over this stage's layers. There each residual add is done by
    the norm that follows it; at the end of a stage before the last no norm follows, so the
    residual stream (what the next stage takes in) is summed here."""
    f = model.fused
    start, end = model.pp_layers
    layers = model.layers[start:end]
    norms_after = [layer.input_layernorm for layer in layers[1:]] + [model.norm if last else None]
    first = layers[0].input_layernorm
    x, h = f.rms_norm(x, first.weight, first.eps)
    for layer, next_norm in zip(layers, norms_after):
        attn = layer.self_attn(h, cos, sin, ctx, fused=f)
        post = layer.post_attention_layernorm
        x, h = f.rms_norm(x, post.weight, post.eps, delta=attn)
        mlp = layer.mlp.down_proj(f.silu_mul(layer.mlp.gate_up_proj(h)))
        if next_norm is None:
            return x + mlp
        x, h = f.rms_norm(x, next_norm.weight, next_norm.eps, delta=mlp)
    return h
