"""DeepSeek-V3's multi-token-prediction layer as a drafting head (method mtp).

A checkpoint with num_nextn_predict_layers = 1 keeps the layer at model.layers.{L}.*, L =
num_hidden_layers (which the DeepSeek loader skips when it builds the target): enorm and hnorm
(RMSNorms), eh_proj (Linear(2 * hidden, hidden)), a full DeepSeek decoder layer (MLA, and MoE or
a dense MLP as layer L of the family would have), shared_head.norm and shared_head.head, and
optionally embed_tokens (else the target's embedding; a missing shared_head.head: the target's
LM head). Row r: eh_proj(cat(enorm(embed(token)), hnorm(h))) through the layer, h the target's
hidden state BEFORE its final norm (drafting further: the layer's own output); logits
shared_head.head(shared_head.norm(out)). With k > 1 the one layer drafts every position.
"""
from __future__ import annotations

import dataclasses

import torch
from safetensors import safe_open
from torch import nn

from pdserve.engine.speculation import SpeculationHost
from pdserve.models.deepseek import DeepseekDecoderLayer, DeepseekModel, _copy, _targets, deepseek_spec
from pdserve.models.llama import RMSNorm
from pdserve.models.loader import resolve_model_path, safetensors_files
from pdserve.spec_decode.head_proposer import HeadProposer
from pdserve.spec_decode.target_vocab import TargetVocab, target_vocab


class MtpHead(nn.Module):
    def __init__(self, spec, target: DeepseekModel, vocab: TargetVocab, layer: int, own_embedding: bool,
                 own_head: bool):
        super().__init__()
        h = spec.hidden_size
        # The layer keeps its checkpoint index L (its MLP kind and weight names follow from it);
        # its attention reads the head's one-layer cache.
        self.spec = dataclasses.replace(spec, num_layers=layer + 1)
        self.layers = nn.ModuleDict({str(layer): DeepseekDecoderLayer(spec, layer)})
        self.layers[str(layer)].self_attn.layer_idx = 0
        self._layer = str(layer)
        self.enorm, self.hnorm = RMSNorm(h, spec.rms_norm_eps), RMSNorm(h, spec.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, spec.rms_norm_eps)
        self.shared_head.head = nn.Linear(h, spec.vocab_size, bias=False) if own_head else None
        self.embed_tokens = nn.Embedding(spec.vocab_size, h) if own_embedding else None
        self._target = (target,)  # shared, not a submodule
        self._vocab = (vocab,)  # the target's embedding and LM head (whole on the driver at TP > 1)
        self.hidden_in: torch.Tensor | None = None
        self.fused = None

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        target = self._target[0]
        embed = (self.embed_tokens if self.embed_tokens is not None else self._vocab[0].embed)(token_ids)
        x = self.eh_proj(torch.cat([self.enorm(embed), self.hnorm(self.hidden_in)], dim=-1))
        cos, sin = target.rope.cos_sin(positions, x.dtype)
        return self.layers[self._layer](x, cos, sin, ctx)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.shared_head.head is None:
            return self._vocab[0].logits(self.shared_head.norm(hidden))
        return self.shared_head.head(self.shared_head.norm(hidden)).float()


def _mtp_tensors(path, layer: int) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors, named from inside it (enorm.weight, self_attn..., ...)."""
    prefix, out = f"model.layers.{layer}.", {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    out[name.removeprefix(prefix)] = f.get_tensor(name)
    return out


def load_mtp_head(path, host: SpeculationHost) -> tuple[MtpHead, object]:
    from transformers import AutoConfig  # heavy, deferred on purpose: loaded with a head only
    path = resolve_model_path(str(path)) if path is not None else host.model_path
    config = AutoConfig.from_pretrained(str(path))
    target = host.model
    layer = _check(config, target, path)
    tensors = _mtp_tensors(path, layer)
    if not tensors:
        raise ValueError(f"speculative config: method mtp: {path} has no MTP layer weights "
                         f"(model.layers.{layer}.*)")
    spec = deepseek_spec(config)
    with torch.device("meta"):
        head = MtpHead(spec, target, None, layer, "embed_tokens.weight" in tensors,
                       "shared_head.head.weight" in tensors)
    head = head.to_empty(device="cpu")
    params = dict(head.named_parameters())
    filled = dict.fromkeys(params, 0)
    for name, tensor in tensors.items():
        if name.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"):
            if name not in params:
                raise ValueError(f"speculative config: unexpected MTP weight {name!r}")
            targets = [(name, params[name].data)]
        else:
            targets = _targets(head, f"layers.{layer}.{name}", tensor, params)
        for param, view in targets:
            _copy(view, tensor, name)
            filled[param] += tensor.numel()
    missing = sorted(n for n, p in params.items() if filled[n] < p.numel())
    if missing:
        raise ValueError(f"speculative config: the MTP layer in {path} is missing weights: {', '.join(missing[:8])}")
    head = head.to(device=host.device, dtype=host.dtype).eval()
    head._vocab = (target_vocab(host, "mtp"),)
    return head, config


def _check(config, target, path) -> int:
    """The MTP layer's index; ValueError when this checkpoint cannot draft for this target."""
    if not isinstance(target, DeepseekModel) or target.spec.architecture != "DeepseekV3ForCausalLM":
        raise ValueError(f"speculative config: method mtp drafts for DeepSeek-V3 targets; this target is "
                         f"{target.spec.architecture}")
    if not getattr(config, "num_nextn_predict_layers", 0):
        raise ValueError(f"speculative config: method mtp: {path} has no MTP layer "
                         f"(num_nextn_predict_layers is {getattr(config, 'num_nextn_predict_layers', None)})")
    if getattr(config, "quantization_config", None):
        raise ValueError("speculative config: method mtp does not load quantized (FP8) MTP layers yet")
    for key, ours in (("hidden_size", target.spec.hidden_size), ("vocab_size", target.spec.vocab_size)):
        if getattr(config, key) != ours:
            raise ValueError(f"speculative config: the MTP checkpoint's {key} is {getattr(config, key)}, "
                             f"the target's {ours}; they must be the same")
    return config.num_hidden_layers


def mtp_proposer(config, host: SpeculationHost) -> HeadProposer:
    head, head_config = load_mtp_head(config.model, host)
    return HeadProposer(head, head_config, host, pre_norm=True)
