"""Full-precision weights: one [out, in] matrix per rank, multiplied with F.linear.

Under cpu_gemm_dtype bfloat16 (pdserve.kernels.dequant_tiles) a float32 CPU matrix's products
of more than BF16_MIN_ROWS rows (prefill) run in bf16 through oneDNN, on a bf16 copy of the
weights kept beside them (exact for a bf16 checkpoint served in float32; a float32 checkpoint's
weights round to 8 significant bits). Fewer rows stay float32: decode steps are memory-bound, and
the compiled step reads the float32 rows themselves."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.dequant_tiles import tile_dtype
from pdserve.layers.quant.base import QuantConfig, QuantMethod

BF16_MIN_ROWS = 16  # as quant_cpu.QUANT_GEMV_MAX_TOKENS: more rows are a prefill's, compute-bound


class UnquantizedLinearMethod(QuantMethod):
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype), requires_grad=False)
        layer.register_parameter("weight", weight)
        layer.param_dims["weight"] = (0, 1)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (tile_dtype() == torch.bfloat16 and x.dtype == torch.float32 and x.device.type == "cpu"
                and x.numel() > BF16_MIN_ROWS * x.shape[-1]):
            y = F.linear(x.to(torch.bfloat16), _bf16_weight(layer)).to(x.dtype)
            return y + bias if bias is not None else y
        return F.linear(x, layer.weight, bias)


def _bf16_weight(layer: nn.Module) -> torch.Tensor:
    """The layer's weight in bf16, made on first use and again when the weight's storage changes."""
    key = layer.weight.data_ptr()
    cached = layer.__dict__.get("_bf16_weight")
    if cached is None or cached[0] != key:
        cached = layer.__dict__["_bf16_weight"] = (key, layer.weight.detach().to(torch.bfloat16))
    return cached[1]


class UnquantizedConfig(QuantConfig):
    name = "none"

    def linear_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        return UnquantizedLinearMethod()
