"""Formats that quantize the activations too: FP8 (e4m3) weights with dynamic FP8 activations,
and int8 weights with dynamic int8 activations (W8A8), as compressed-tensors and DeepSeek-V3's
FP8 checkpoints ship them. The weights stay 8-bit in memory.

A layer holds
- `weight` [rows, K]: the checkpoint's bytes, uint8 for FP8 (e4m3 bits) and int8 for int8;
- `weight_scale` [rows, ceil(K / block)] float32 (held as its 32 bits, int32, so casting the
  model to its serving dtype leaves it alone): one scale per row and block of `block` columns.
  Per-tensor and per-channel checkpoints have one column (block = K); a 128x128 block checkpoint's
  scales are repeated down the 128 rows of each block at load (expand_scale), which lets the
  parts of a fused layer (q, k, v; gate, up) sit side by side whatever their row counts.

Activations are quantized per token, in groups of `block` columns for block checkpoints
(DeepSeek-V3's and compressed-tensors' FP8_BLOCK: 128), symmetric, with the scale from the
group's largest magnitude:
- FP8: s = max(amax, 1e-10) / 448, x_q = e4m3(clamp(x / s, -448, 448));
- int8: s = max(amax, 1e-10) / 127, x_q = clamp(round(x / s), -128, 127).
(vLLM's per-token quantizers, in plain torch.) The output is x_q * s times the dequantized
weight, summed: FP8 through pdserve.kernels.fp8_cpu, int8 through torch._int_mm (exact int32
sums, then both scales).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import fp8_cpu
from pdserve.layers.quant import cuda_kernels
from pdserve.layers.quant.base import QuantMethod

FP8_MAX = 448.0
INT8_MAX = 127.0
AMAX_FLOOR = 1e-10  # an all-zero token (or group) still gets a finite scale
INT_MM_MIN_CUDA_ROWS = 16  # torch._int_mm on CUDA takes more rows than this


def fp8_quant_dequant(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [T, K] float32 -> e4m3(x / s) * s, s per token and group of `group` columns."""
    tokens, cols = x.shape
    groups = math.ceil(cols / group)
    padded = F.pad(x, (0, groups * group - cols)).view(tokens, groups, group)
    scale = padded.abs().amax(-1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    q = (padded / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).view(tokens, groups * group)[:, :cols]


def int8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] float32 -> (x_q int8 [T, K], s float32 [T, 1]), per token."""
    scale = x.abs().amax(-1, keepdim=True).clamp(min=AMAX_FLOOR) / INT8_MAX
    return (x / scale).round().clamp(-128, 127).to(torch.int8), scale


def expand_scale(scale: torch.Tensor, rows: int, block_rows: int) -> torch.Tensor:
    """A checkpoint's weight scale -> float32 [rows, column blocks]: a per-tensor scale repeated
    down every row, a per-channel one as it is, a block one repeated down its block's rows."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, 1).contiguous()
    if block_rows:
        return scale.repeat_interleave(block_rows, dim=0)[:rows].contiguous()
    return scale.reshape(rows, -1).contiguous()


def scale_bits(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales as the int32 parameter that holds them."""
    return scale.float().contiguous().view(torch.int32)


class ActQuantLinearMethod(QuantMethod):
    weight_dtype = torch.uint8

    def __init__(self, block: int = 0):
        """block: columns per weight scale and per activation group; 0: all of them."""
        self.block = block

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        rows, block = sum(output_sizes), self.block or input_size
        if self.block and input_size % self.block and getattr(layer, "split_input", False) and layer.tp.size > 1:
            raise ValueError(f"{input_size} input columns per rank are not whole blocks of {self.block}: "
                             f"choose a tensor_parallel_size that keeps them whole")
        layer.register_parameter("weight", nn.Parameter(
            torch.zeros(rows, input_size, dtype=self.weight_dtype), requires_grad=False))
        layer.register_parameter("weight_scale", nn.Parameter(
            torch.zeros(rows, math.ceil(input_size / block), dtype=torch.int32), requires_grad=False))
        layer.param_dims["weight"] = (0, 1)
        layer.param_dims["weight_scale"] = (0, 1 if self.block else None)
        layer.act_block = block

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        y = self.matmul(layer, flat, layer.weight_scale.view(torch.float32))
        y = y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
        return y + bias if bias is not None else y

    def matmul(self, layer: nn.Module, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Fp8LinearMethod(ActQuantLinearMethod):
    weight_dtype = torch.uint8

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if cuda_kernels.runs_triton(x):
            return cuda_kernels.fp8_apply(layer, x, bias)
        return super().apply(layer, x, bias)

    def matmul(self, layer: nn.Module, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return fp8_cpu.fp8_matmul(fp8_quant_dequant(x, layer.act_block), layer.weight, scale, layer.act_block)

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        return fp8_cpu.dequantize(layer.weight, layer.weight_scale.view(torch.float32), layer.act_block)


class Int8LinearMethod(ActQuantLinearMethod):
    """Per-channel (or per-tensor) int8 weights; activations per token (block 0 only)."""
    weight_dtype = torch.int8

    def matmul(self, layer: nn.Module, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        q, x_scale = int8_quantize(x)
        rows = q.shape[0]
        if q.is_cuda and rows <= INT_MM_MIN_CUDA_ROWS:  # cuBLAS's int8 GEMM wants more rows: pad
            q = F.pad(q, (0, 0, 0, INT_MM_MIN_CUDA_ROWS + 1 - rows))
        return torch._int_mm(q, layer.weight.t())[:rows].float() * x_scale * scale.reshape(1, -1)

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float() * layer.weight_scale.view(torch.float32)
