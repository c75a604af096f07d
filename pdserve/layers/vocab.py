"""The embedding and the LM head, split over the vocabulary.

Each rank holds a contiguous slice of the vocabulary's rows (the vocabulary padded to a multiple
of the TP size; padding rows are zero and their logits are cut off). The embedding looks up the
tokens its slice holds, zeroes the rest and sums over ranks; the LM head computes its slice of
the logits, and the slices are gathered in rank order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.parallel import get_tp_group
from pdserve.layers.quant.unquantized import unquantized_head_logits


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, params_dtype: torch.dtype | None = None,
                 quant_config=None, prefix: str = "embed_tokens"):
        super().__init__()
        self.tp = get_tp_group()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // self.tp.size)
        self.start = self.tp.rank * self.rows
        dtype = params_dtype or torch.get_default_dtype()
        method = quant_config.linear_method(self, prefix) if quant_config is not None else None
        self.quant_method = method if hasattr(method, "embedding") else None
        if self.quant_method is not None:
            self.param_dims: dict = {}
            self.quant_method.create_weights(self, hidden_size, [self.rows], dtype)
        else:
            self.weight = nn.Parameter(torch.empty(self.rows, hidden_size, dtype=dtype), requires_grad=False)

    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """This rank's rows of the [vocab, ...] checkpoint tensor; padding rows stay zero."""
        param = getattr(self, name)
        end = min(self.start + self.rows, loaded.shape[0])
        if loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                             f"[vocab, {param.shape[1]}]")
        param.data.zero_()
        param.data[: end - self.start].copy_(loaded[self.start:end])

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's parameters (a tied LM head)."""
        for name, param in embedding.named_parameters(recurse=False):
            setattr(self, name, param)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embedding(self, ids)
        return F.embedding(ids, self.weight)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(token_ids)
        local = token_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = self._lookup(local.masked_fill(outside, 0))
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [T, H] -> logits [T, vocab]; shares its weight with the embedding when tied."""

    def compute(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            logits = self.quant_method.apply(self, hidden, None)
        else:
            logits = unquantized_head_logits(self, hidden)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last(logits)[..., : self.vocab_size]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute(hidden)
