"""The contract between a linear layer and the format of its weights (vLLM's
QuantizeMethodBase, in small).

A layer knows its shape and its tensor-parallel shard; its QuantMethod knows the bytes:
- create_weights registers the layer's parameters for its shard (full precision: `weight`
  [out, in]; a quantized format: packed weights and scales), and records in
  `layer.param_dims[name]` which dimension of each holds output rows and input columns;
- the checkpoint loader calls `layer.weight_loader(name, tensor, shard_id)` with the whole
  checkpoint tensor of one part (q, k, v, gate, up, or the only one); the loader takes this
  rank's slice and writes it where the part lives in the fused parameter;
- process_weights_after_loading repacks what was loaded into what the kernel reads;
- apply(layer, x, bias) is the layer's matmul.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


def quantization_dict(config) -> dict | None:
    """A model config's quantization_config as a dict (transformers keeps some as objects);
    None for full-precision weights."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return None
    return quantization if isinstance(quantization, dict) else quantization.to_dict()


class QuantMethod(ABC):
    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        """Register the parameters of one rank's shard: input_size columns, and output rows in
        parts (output_sizes: one entry per fused part, already divided by the TP size)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [tokens, input_size] -> [tokens, sum(output_sizes)]."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded parameters into the layout apply reads (nothing by default)."""
        return None

    def weight_bytes(self, layer: nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in layer.state_dict().values())


class QuantConfig(ABC):
    """A checkpoint's quantization scheme: which method each linear layer gets."""

    name: str = "none"

    @abstractmethod
    def linear_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        """The method for the layer whose parameters are named `prefix`.*."""
