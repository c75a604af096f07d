"""Full-precision weights: one [out, in] matrix per rank, multiplied with F.linear."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.quant.base import QuantConfig, QuantMethod


class UnquantizedLinearMethod(QuantMethod):
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype), requires_grad=False)
        layer.register_parameter("weight", weight)
        layer.param_dims["weight"] = (0, 1)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class UnquantizedConfig(QuantConfig):
    name = "none"

    def linear_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        return UnquantizedLinearMethod()
