"""The decoder scaffold shared by the families with a module of their own (MoE, Gemma 3,
gpt-oss): embedding, a stack of layers each with its RoPE table, final norm, LM head, and the
build-and-load sequence. Each family supplies its layers and its checkpoint name mapping."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from pdserve.models.llama import ModelSpec
from pdserve.models.rope import RotaryEmbedding
from pdserve.models.weights import WeightLoader, checkpoint_tensors


def summing_group(model: nn.Module):
    """The rank group whose all-reduce sums each layer's attention and MLP outputs where the
    model is a tensor-parallel shard (pdserve.models.tp_shard's one hook on each), which the
    compiled decode step then calls at the same two points; None for a whole model; or why the
    compiled step cannot take the layers (a pipeline stage, other hooks)."""
    if getattr(model, "pp_layers", None) is not None:
        return "the model is a pipeline stage"
    modules = [m for layer in model.layers for m in (layer.self_attn, layer.mlp)]
    if not any(m._forward_hooks for m in modules):
        return None
    group = getattr(modules[0], "tp_sum_group", None)
    if group is None or any(len(m._forward_hooks) != 1 or getattr(m, "tp_sum_group", None) is not group
                            for m in modules):
        return "the layers have forward hooks other than a tensor-parallel rank group's sum"
    return group


class DecoderModel(nn.Module):
    """forward(token_ids [T], positions [T], ctx) -> final hidden states [T, hidden].

    layers[i](x, cos, sin, ctx) -> x; layer i uses ropes[layer_rope[i]]."""

    # The engine serves the model's own sliding windows rather than capping prompts at them.
    handles_sliding_window = True
    # pdserve.kernels.native_decode.NativeDecode on CPU, for a family whose model declares its
    # arrays (native_decode_weights; set by the model runner): a decode step's layers in one
    # compiled call. None: the layers run in Python.
    native_decode = None

    def __init__(self, spec: ModelSpec, layers: list[nn.Module], norm: nn.Module,
                 ropes: dict[str, RotaryEmbedding], layer_rope: list[str], *,
                 embed_scale: float | None = None, final_softcap: float | None = None,
                 cuda_graph_safe: bool | Callable[[], bool] = True):
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.ropes, self.layer_rope = ropes, layer_rope
        self.embed_scale, self.final_softcap = embed_scale, final_softcap
        # MoE layers are capturable only without host synchronisation (asked lazily: only the
        # CUDA model runner reads it).
        self._graph_safe = cuda_graph_safe
        self.fused = None  # set by the model runner; these families run their ops in torch

    @property
    def cuda_graph_safe(self) -> bool:
        return self._graph_safe() if callable(self._graph_safe) else self._graph_safe

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, ctx, images=None) -> torch.Tensor:
        """images: a vision-language model's image rows (pdserve.engine.multimodal.ImageRows)."""
        x = self.embed_tokens(token_ids)
        if self.embed_scale is not None:  # as transformers: the scale rounded to the dtype first
            x = x * torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype)
        if images is not None:  # after the scale, as transformers (image rows are not scaled)
            x = images.merge(x)
        tables = {name: rope.cos_sin(positions, x.dtype) for name, rope in self.ropes.items()}
        if images is None and self.native_decode is not None and self.native_decode.takes(x, ctx):
            names = sorted(self.ropes)  # the tables in the order the plan numbered them
            return self.native_decode.forward(x, torch.stack([tables[n][0] for n in names]),
                                              torch.stack([tables[n][1] for n in names]), ctx)
        for layer, rope in zip(self.layers, self.layer_rope):
            x = layer(x, *tables.get(rope, (None, None)), ctx)  # (None: a layer without RoPE)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()

    def shard_sizes(self, name: str) -> list[int]:
        """Row counts of a fused parameter's parts: q/k/v, or gate/up halves."""
        owner, sep, _ = name.rpartition(".qkv_proj.")
        if sep:
            return self.get_submodule(owner).shard_sizes()
        rows = self.get_parameter(name).shape[0]
        return [rows // 2, rows // 2]


def build_and_load(make: Callable[[], DecoderModel], files: list[Path],
                   place: Callable[[str, torch.Tensor, WeightLoader], None],
                   dtype: torch.dtype, device: torch.device) -> DecoderModel:
    """Build the model without memory, load every checkpoint tensor through place(name without
    'model.', tensor, loader), check nothing is missing, move to device and dtype."""
    with torch.device("meta"):
        model = make()
    model = model.to_empty(device="cpu")
    loader = WeightLoader(model, model.shard_sizes)
    tied = model.spec.tie_word_embeddings
    for name, tensor in checkpoint_tensors(files):
        if "rotary_emb" in name or (tied and name == "lm_head.weight"):
            continue
        place(name, tensor, loader)
    loader.check_complete(tied=("lm_head.weight",) if tied else ())
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    model.ropes = {name: rope.to(device) for name, rope in model.ropes.items()}
    return model.to(device=device, dtype=dtype).eval()
