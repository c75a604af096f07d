"""The CUDA path of the quantized linear methods: the layer's parameters, as loaded for CPU,
handed to the GPU kernels (pdserve.kernels.triton_quant and triton_quant_scaled_mm). Nothing is
dequantized at load; the CPU path does not come through here.

- FP8, one scale per row (per channel, per tensor): torch._scaled_mm, activations per token;
- FP8 in column blocks (DeepSeek-V3, Qwen3-FP8): the Triton block-scaled GEMM on pdserve's
  per-row scale layout (scale_row_block 1), so fused parts of any row count need nothing special;
- grouped int4/int8 (W4A16, GGUF, GPTQ/AWQ): the Triton grouped GEMM, unpacked in registers.
"""
from __future__ import annotations

import torch
from torch import nn


def runs_triton(x: torch.Tensor) -> bool:
    """Whether a layer's input goes to the GPU kernels (tests force this on CPU, where the
    Triton interpreter runs them)."""
    return x.is_cuda


def _finish(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y + bias if bias is not None else y


def fp8_apply(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from pdserve.kernels import triton_quant, triton_quant_scaled_mm  # imports triton: heavy, the CUDA path only
    flat = x.reshape(-1, x.shape[-1])
    scale = layer.weight_scale.view(torch.float32)
    if scale.shape[1] == 1:  # per channel or per tensor
        y = triton_quant_scaled_mm.fp8_channel_matmul(flat, layer.weight, scale, out_dtype=x.dtype)
    else:
        y = triton_quant.fp8_block_matmul(flat, layer.weight, scale, layer.act_block, scale_row_block=1,
                                          out_dtype=x.dtype)
    return _finish(y, x, bias)


def grouped_apply(layer: nn.Module, parts, bits: int, group: int, x: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """parts: (q, scales, mins) as GroupedLinearMethod._parts gives them."""
    from pdserve.kernels import triton_quant  # imports triton: heavy, the CUDA path only
    q, scales, mins = parts
    y = triton_quant.grouped_matmul(x.reshape(-1, x.shape[-1]), q, scales, mins, bits, group)
    return _finish(y, x, bias)


def grouped_rows(parts, bits: int, group: int, row_ids: torch.Tensor | None) -> torch.Tensor:
    """float32 rows of a grouped matrix in torch on its own device (an embedding's lookups)."""
    from pdserve.kernels import triton_quant  # imports triton: heavy, the CUDA path only
    q, scales, mins = parts
    if row_ids is not None:
        ids = row_ids.reshape(-1)
        q, scales, mins = q[ids], scales[ids], None if mins is None else mins[ids]
    return triton_quant.grouped_dequantize(q, scales, mins, bits, group)
