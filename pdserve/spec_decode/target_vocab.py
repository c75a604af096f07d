"""The target's embedding and LM head as a drafting head (EAGLE, MTP) uses them.

At TP 1 they are the target's own layers. At TP > 1 the target's are split over the vocabulary
and each lookup or logits pass is a collective every rank must join, while the head runs on the
driver alone (it is one layer; the workers never see its steps). So the driver reads the two
tensors whole from the target's checkpoint: vocab x hidden twice (once if tied) of extra memory
on the driver, and no collective in a draft step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors import safe_open

from pdserve.models.loader import safetensors_files

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


class TargetVocab:
    """embed(token ids) -> [T, hidden]; logits(hidden) -> float32 [T, vocab]."""

    def __init__(self, target, embed_weight: torch.Tensor | None = None, head_weight: torch.Tensor | None = None):
        self._target = (target,)  # shared, not a submodule
        self.embed_weight, self.head_weight = embed_weight, head_weight

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_weight is None:
            return self._target[0].embed_tokens(token_ids)
        return F.embedding(token_ids, self.embed_weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_weight is None:
            return self._target[0].compute_logits(hidden)
        return F.linear(hidden, self.head_weight).float()


def target_vocab(host, method: str) -> TargetVocab:
    """The target's vocabulary layers for a head on the driver (whole ones at TP > 1)."""
    if host.config.tensor_parallel_size == 1:
        return TargetVocab(host.model)
    found = _read(host.model_path, (EMBED, HEAD))
    embed = found.get(EMBED)
    head = found.get(HEAD, embed if getattr(host.model.spec, "tie_word_embeddings", False) else None)
    if embed is None or head is None or not embed.is_floating_point() or not head.is_floating_point():
        raise ValueError(f"speculative decoding method {method} with tensor_parallel_size > 1 reads the target's "
                         f"embedding and LM head whole from its checkpoint ({EMBED}, {HEAD}), which "
                         f"{host.model_path} does not hold unquantized")
    return TargetVocab(host.model, embed.to(host.device, host.dtype), head.to(host.device, host.dtype))


def _read(path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    out = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                if name in f.keys():
                    out[name] = f.get_tensor(name)
    return out
