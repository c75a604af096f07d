"""MoE experts that stay quantized: FP8 (DeepSeek-V3's block checkpoints,
pdserve.layers.quant.fp8_block) and MXFP4 (gpt-oss, pdserve.layers.quant.mxfp4).

Fp8Experts holds each projection as its e4m3 bytes, gate_up_proj [E, 2I, H] and down_proj
[E, H, I] (uint8), with act_quant's per-row scales: gate_up_scale [E, 2I, ceil(H / block)] and
down_scale [E, H, ceil(I / block)] (float32 held as int32). Each expert that has tokens in a step
multiplies them through pdserve.kernels.fp8_cpu, its input quantized per token in groups of
`block` columns as every other FP8 layer's is: one FP8 matmul per projection and active expert
(a loop over experts, never over tokens). On CUDA every expert runs in two grouped Triton GEMMs
with the block scales applied per K tile (pdserve.kernels.triton_quant_moe).

Mxfp4Experts holds gpt-oss's packed experts as they are: gate_up_proj [E, 2I, H / 2] and
down_proj [E, H, I / 2] (two e2m1 codes a byte), gate_up_scale [E, 2I, H / 32] and down_scale
[E, H, I / 32] (uint8 powers of two), and float biases; its activations stay float (weight-only),
through pdserve.kernels.mxfp4_cpu; on CUDA through two grouped Triton GEMMs that unpack the codes
and scales in registers (pdserve.kernels.triton_quant_mxfp4).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from pdserve.kernels import fp8_cpu, mxfp4_cpu
from pdserve.layers.quant import cuda_kernels
from pdserve.layers.quant.act_quant import fp8_quant_dequant
from pdserve.models.moe import Experts, silu_mul


class _LoopedExperts(Experts):
    """Experts whose kernels take one expert at a time: Experts.forward calls _expert for each
    expert with tokens in the step."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if cuda_kernels.runs_triton(x):  # the GPU: every expert in two grouped Triton GEMMs
            return self._fused(x, ids, weights)
        return super().forward(x, ids, weights)

    def _fused(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _cpu_grouped_matmul(self, x: torch.Tensor, pairs: int):
        return None

    def _register(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        for name, (shape, dtype) in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))


class Fp8Experts(_LoopedExperts):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, block: int,
                 activation: Callable[[torch.Tensor], torch.Tensor] = silu_mul):
        nn.Module.__init__(self)
        self.num_experts, self.intermediate, self.block, self.activation = num_experts, intermediate, block, activation
        shapes = {"gate_up_proj": ((num_experts, 2 * intermediate, hidden), torch.uint8),
                  "gate_up_scale": ((num_experts, 2 * intermediate, math.ceil(hidden / block)), torch.int32),
                  "down_proj": ((num_experts, hidden, intermediate), torch.uint8),
                  "down_scale": ((num_experts, hidden, math.ceil(intermediate / block)), torch.int32)}
        self._register(shapes)
        self.gate_up_bias = self.down_bias = None

    @classmethod
    def like(cls, experts: Experts, block: int) -> Fp8Experts:
        hidden = experts.gate_up_proj.shape[2]
        return cls(experts.num_experts, hidden, experts.intermediate, block, experts.activation)

    def _fused(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from pdserve.kernels import triton_quant_moe  # imports triton: heavy, the CUDA path only
        return triton_quant_moe.fp8_fused_experts(
            x, ids, weights, self.gate_up_proj, self.gate_up_scale.view(torch.float32), self.down_proj,
            self.down_scale.view(torch.float32), self.block, self.activation)

    def _expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        b = self.block
        y = fp8_cpu.fp8_matmul(fp8_quant_dequant(h.float(), b), self.gate_up_proj[e],
                               self.gate_up_scale[e].view(torch.float32), b)
        y = self.activation(y)
        y = fp8_cpu.fp8_matmul(fp8_quant_dequant(y, b), self.down_proj[e], self.down_scale[e].view(torch.float32), b)
        return y.to(h.dtype)


class Mxfp4Experts(_LoopedExperts):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, bias: bool,
                 activation: Callable[[torch.Tensor], torch.Tensor] = silu_mul):
        nn.Module.__init__(self)
        if hidden % 32 or intermediate % 32:
            raise ValueError(f"MXFP4 experts need sizes in multiples of 32 (hidden {hidden}, intermediate {intermediate})")
        self.num_experts, self.intermediate, self.activation = num_experts, intermediate, activation
        e, i2 = num_experts, 2 * intermediate
        self._register({"gate_up_proj": ((e, i2, hidden // 2), torch.uint8),
                        "gate_up_scale": ((e, i2, hidden // 32), torch.uint8),
                        "down_proj": ((e, hidden, intermediate // 2), torch.uint8),
                        "down_scale": ((e, hidden, intermediate // 32), torch.uint8)})
        self.gate_up_bias = nn.Parameter(torch.zeros(e, i2), requires_grad=False) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(e, hidden), requires_grad=False) if bias else None

    @classmethod
    def like(cls, experts: Experts) -> Mxfp4Experts:
        return cls(experts.num_experts, experts.gate_up_proj.shape[2], experts.intermediate,
                   experts.gate_up_bias is not None, experts.activation)

    def _fused(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from pdserve.kernels import triton_quant_mxfp4  # imports triton: heavy, the CUDA path only
        return triton_quant_mxfp4.mxfp4_fused_experts(
            x, ids, weights, self.gate_up_proj, self.gate_up_scale, self.down_proj, self.down_scale,
            self.activation, self.gate_up_bias, self.down_bias)

    def _expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        y = mxfp4_cpu.mxfp4_matmul(h, self.gate_up_proj[e], self.gate_up_scale[e])
        if self.gate_up_bias is not None:
            y = y + self.gate_up_bias[e].float()
        y = mxfp4_cpu.mxfp4_matmul(self.activation(y), self.down_proj[e], self.down_scale[e])
        if self.down_bias is not None:
            y = y + self.down_bias[e].float()
        return y.to(h.dtype)
