"""Group-quantized weights: w[n, k] = q[n, k] * scale[n, k // group] (+ min[n, k // group]).

One format covers every weight-only scheme pdserve keeps quantized: GGUF's Q4_0, Q4_1, Q8_0,
Q4_K, Q5_K and Q6_K, and compressed-tensors' int4/int8 (see gguf_blocks.py and
compressed_tensors.py for how each maps onto it). A GroupFormat says how a layer holds it:
- bits 4 (q in 0..15, two per byte, pdserve.kernels.quant_cpu's order) or 8 (int8);
- group: columns per scale;
- half_scales: scales and mins are float16 (stored as their 16 bits, int16), else float32
  (stored as their 32 bits, int32). Every parameter is an integer tensor, so casting the model
  to its serving dtype leaves them alone;
- has_min: a per-group offset (asymmetric formats); without one, min is 0.

Fused layers whose parts come in different formats take the smallest format that holds each
part exactly (see common_format).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pdserve.kernels import quant_cpu
from pdserve.layers.quant import cuda_kernels
from pdserve.layers.quant.base import QuantMethod

# A fused layer's checkpoint parts, by the last component of its prefix (qkv_proj -> q, k, v).
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class GroupFormat:
    bits: int
    group: int
    half_scales: bool
    has_min: bool


@dataclass
class GroupedWeight:
    """One checkpoint matrix decoded to q values and per-group scales (numpy, not packed):
    q uint8 (0..15 or 0..31) or int8 [rows, cols]; scales, mins float16 or float32 [rows, cols // group]."""
    q: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    group: int
    bits: int  # 4: every q is in 0..15; 8: q fits int8

    def native_format(self) -> GroupFormat:
        return GroupFormat(self.bits, self.group, self.scales.dtype == np.float16, self.mins is not None)

    def to_params(self, fmt: GroupFormat) -> dict[str, torch.Tensor]:
        """The layer parameters of this matrix in `fmt`, which must hold it exactly."""
        if self.group % fmt.group:
            raise ValueError(f"a matrix in groups of {self.group} cannot be held in groups of {fmt.group}")
        repeat = self.group // fmt.group
        scale_dtype = np.float16 if fmt.half_scales else np.float32
        params = {"qweight": torch.from_numpy(_pack(self.q, fmt.bits)),
                  "scales": _scale_param(np.repeat(self.scales, repeat, axis=1).astype(scale_dtype))}
        if fmt.has_min:
            mins = self.mins if self.mins is not None else np.zeros_like(self.scales)
            params["mins"] = _scale_param(np.repeat(mins, repeat, axis=1).astype(scale_dtype))
        return params


def common_format(formats: list[GroupFormat]) -> GroupFormat:
    """The smallest format that holds each of `formats` exactly (the parts of one fused layer)."""
    group = min(f.group for f in formats)
    if any(f.group % group for f in formats):
        raise ValueError(f"group sizes {sorted({f.group for f in formats})} do not nest")
    return GroupFormat(bits=max(f.bits for f in formats), group=group,
                       half_scales=all(f.half_scales for f in formats), has_min=any(f.has_min for f in formats))


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return np.ascontiguousarray(q.astype(np.int8))
    rows, cols = q.shape
    runs = q.astype(np.uint8).reshape(rows, cols // 32, 2, 16)
    return np.ascontiguousarray((runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(rows, cols // 2))


def _scale_param(values: np.ndarray) -> torch.Tensor:
    bits = np.int16 if values.dtype == np.float16 else np.int32
    return torch.from_numpy(np.ascontiguousarray(values).view(bits))


def scales_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.float16) if t.dtype == torch.int16 else t.view(torch.float32)


class GroupedLinearMethod(QuantMethod):
    def __init__(self, fmt: GroupFormat):
        self.fmt = fmt

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        fmt, rows = self.fmt, sum(output_sizes)
        if input_size % max(fmt.group, 32) or fmt.group % 16 or (fmt.group > 16 and fmt.group % 32):
            raise ValueError(f"{input_size} input columns in groups of {fmt.group}: the kernels take groups "
                             f"of 16 or a multiple of 32 columns, and a multiple of 32 columns")
        qcols, qdtype = (input_size // 2, torch.uint8) if fmt.bits == 4 else (input_size, torch.int8)
        scale_dtype = torch.int16 if fmt.half_scales else torch.int32
        shapes = {"qweight": ((rows, qcols), qdtype), "scales": ((rows, input_size // fmt.group), scale_dtype)}
        if fmt.has_min:
            shapes["mins"] = shapes["scales"]
        for name, (shape, param_dtype) in shapes.items():
            layer.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=param_dtype), requires_grad=False))
            layer.param_dims[name] = (0, 1)

    def _parts(self, layer: nn.Module):
        mins = scales_view(layer.mins) if self.fmt.has_min else None
        return layer.qweight, scales_view(layer.scales), mins

    def packed(self, layer: nn.Module) -> quant_cpu.PackedMatrix:
        """The kernels' views of the layer's parameters, made on first use and again whenever a
        parameter's storage changes (a reload or a tie)."""
        key = (layer.qweight.data_ptr(), layer.scales.data_ptr(), layer.mins.data_ptr() if self.fmt.has_min else 0)
        cached = layer.__dict__.get("_packed_matrix")
        if cached is None or cached[0] != key:
            cached = layer.__dict__["_packed_matrix"] = (
                key, quant_cpu.PackedMatrix.of(self.fmt.bits, *self._parts(layer), self.fmt.group))
        return cached[1]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if cuda_kernels.runs_triton(x):
            return cuda_kernels.grouped_apply(layer, self._parts(layer), self.fmt.bits, self.fmt.group, x, bias)
        flat = x.reshape(-1, x.shape[-1])
        y = quant_cpu.packed_matmul(flat, self.packed(layer))
        if y.dtype != x.dtype or x.dim() != 2:
            y = y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
        return y + bias if bias is not None else y

    def embedding(self, layer: nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows token_ids of the matrix, dequantized: only the looked-up rows are ever widened."""
        if cuda_kernels.runs_triton(token_ids):
            rows = cuda_kernels.grouped_rows(self._parts(layer), self.fmt.bits, self.fmt.group, token_ids)
            return rows.reshape(*token_ids.shape, rows.shape[-1])
        q, scales, mins = self._parts(layer)
        rows = quant_cpu.dequantize_rows(self.fmt.bits, q, scales, mins, self.fmt.group, token_ids)
        return rows.reshape(*token_ids.shape, rows.shape[-1])

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        if layer.qweight.is_cuda:
            return cuda_kernels.grouped_rows(self._parts(layer), self.fmt.bits, self.fmt.group, None)
        q, scales, mins = self._parts(layer)
        return quant_cpu.dequantize_rows(self.fmt.bits, q, scales, mins, self.fmt.group)
