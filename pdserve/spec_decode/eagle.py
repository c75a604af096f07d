"""An EAGLE-1 head for a Llama-family target, loaded as vLLM's llama_eagle.py loads it.

A Hugging Face directory: config.json (a LlamaConfig with one hidden layer; architectures such
as EagleLlamaForCausalLM or LlamaForCausalLMEagle) and weights fc.weight (Linear(2 * hidden,
hidden), fc.bias optional), layers.0.* (one Llama decoder layer whose input_layernorm is the
identity: a checkpoint's copy is ignored, as EAGLE-1 does) and optionally embed_tokens.weight
(else the target's embedding). No final norm; the logits are the target's LM head's (at TP > 1
whole copies of both on the driver, where the head runs: pdserve.spec_decode.target_vocab).

Row r: fc(cat(embed(token), h)) through the layer, h the target's hidden state after its final
norm at the position before the token (or, drafting further, the head's own output there).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from pdserve.engine.speculation import SpeculationHost
from pdserve.models.llama import DecoderLayer, LlamaModel
from pdserve.models.loader import _place, resolve_model_path, safetensors_files, spec_from_config
from pdserve.models.rope import RotaryEmbedding
from pdserve.models.weights import checkpoint_tensors
from pdserve.spec_decode.head_proposer import HeadProposer
from pdserve.spec_decode.target_vocab import TargetVocab, target_vocab


class EagleHead(nn.Module):
    def __init__(self, spec, rope: RotaryEmbedding, target: TargetVocab, fc_bias: bool, own_embedding: bool):
        super().__init__()
        self.spec, self.rope = spec, rope
        self.fc = nn.Linear(2 * spec.hidden_size, spec.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(spec, 0)])
        self.layers[0].input_layernorm = nn.Identity()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size) if own_embedding else None
        self._target = (target,)  # shared, not a submodule: its weights stay the target's
        self.hidden_in: torch.Tensor | None = None  # set before each pass: one row per token
        self.fused = None

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        embed = self.embed_tokens if self.embed_tokens is not None else self._target[0].embed
        x = self.fc(torch.cat([embed(token_ids), self.hidden_in], dim=-1))
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        return self.layers[0](x, cos, sin, ctx)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].logits(hidden)


def load_eagle_head(path, host: SpeculationHost) -> tuple[EagleHead, object]:
    """The head and its config; ValueError when it cannot serve this target."""
    from transformers import AutoConfig  # heavy, deferred on purpose: loaded with a head only
    path = resolve_model_path(str(path))
    config = AutoConfig.from_pretrained(str(path))
    target = host.model
    _check(config, target)
    tensors = {name.removeprefix("model."): t for name, t in checkpoint_tensors(safetensors_files(path))}
    llama = copy.deepcopy(config)
    llama.architectures = ["LlamaForCausalLM"]
    spec = spec_from_config(llama)
    rope = RotaryEmbedding(llama, spec.head_dim, spec.max_position_embeddings)
    with torch.device("meta"):
        head = EagleHead(spec, rope, None, "fc.bias" in tensors, "embed_tokens.weight" in tensors)
    head = head.to_empty(device="cpu")
    params = dict(head.named_parameters())
    loaded: set[str] = set()
    for name, tensor in tensors.items():
        if name.startswith("lm_head.") or name.startswith("layers.0.input_layernorm."):
            continue  # the target's LM head; EAGLE-1's first layer has no input norm
        loaded.update(_place(name, tensor, head, params, spec))
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"speculative config: the EAGLE head {path} is missing weights: {', '.join(missing)}")
    head.rope = rope.to(host.device)
    head._target = (target_vocab(host, "eagle"),)
    return head.to(device=host.device, dtype=host.dtype).eval(), config


def _check(config, target) -> None:
    if not isinstance(target, LlamaModel):
        raise ValueError(f"speculative config: method eagle drafts for Llama-family targets; "
                         f"this target is {target.spec.architecture}")
    want = target.spec
    if config.num_hidden_layers != 1:
        raise ValueError(f"speculative config: an EAGLE-1 head has one layer; this one has {config.num_hidden_layers}")
    for key, ours in (("hidden_size", want.hidden_size), ("vocab_size", want.vocab_size)):
        if getattr(config, key) != ours:
            raise ValueError(f"speculative config: the EAGLE head's {key} is {getattr(config, key)}, "
                             f"the target's {ours}; they must be the same")


def eagle_proposer(config, host: SpeculationHost) -> HeadProposer:
    head, head_config = load_eagle_head(config.model, host)
    return HeadProposer(head, head_config, host, pre_norm=False)
