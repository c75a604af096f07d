"""MoE experts that stay FP8 (DeepSeek-V3's block checkpoints, pdserve.layers.quant.fp8_block).

Fp8Experts holds each projection as its e4m3 bytes, gate_up_proj [E, 2I, H] and down_proj
[E, H, I] (uint8), with act_quant's per-row scales: gate_up_scale [E, 2I, ceil(H / block)] and
down_scale [E, H, ceil(I / block)] (float32 held as int32). Each expert that has tokens in a step
multiplies them through pdserve.kernels.fp8_cpu, its input quantized per token in groups of
`block` columns as every other FP8 layer's is: one FP8 matmul per projection and active expert
(a loop over experts, never over tokens).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from pdserve.kernels import fp8_cpu
from pdserve.layers.quant.act_quant import fp8_quant_dequant
from pdserve.models.moe import Experts, silu_mul


class Fp8Experts(Experts):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, block: int,
                 activation: Callable[[torch.Tensor], torch.Tensor] = silu_mul):
        nn.Module.__init__(self)
        self.num_experts, self.intermediate, self.block, self.activation = num_experts, intermediate, block, activation
        shapes = {"gate_up_proj": ((num_experts, 2 * intermediate, hidden), torch.uint8),
                  "gate_up_scale": ((num_experts, 2 * intermediate, math.ceil(hidden / block)), torch.int32),
                  "down_proj": ((num_experts, hidden, intermediate), torch.uint8),
                  "down_scale": ((num_experts, hidden, math.ceil(intermediate / block)), torch.int32)}
        for name, (shape, dtype) in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))
        self.gate_up_bias = self.down_bias = None

    @classmethod
    def like(cls, experts: Experts, block: int) -> Fp8Experts:
        hidden = experts.gate_up_proj.shape[2]
        return cls(experts.num_experts, hidden, experts.intermediate, block, experts.activation)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            raise RuntimeError("FP8 experts run on CPU only so far")
        return super().forward(x, ids, weights)

    def _cpu_grouped_matmul(self, x: torch.Tensor, pairs: int):
        return None  # Experts.forward then calls _expert once per expert with tokens

    def _expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        b = self.block
        y = fp8_cpu.fp8_matmul(fp8_quant_dequant(h.float(), b), self.gate_up_proj[e],
                               self.gate_up_scale[e].view(torch.float32), b)
        y = self.activation(y)
        y = fp8_cpu.fp8_matmul(fp8_quant_dequant(y, b), self.down_proj[e], self.down_scale[e].view(torch.float32), b)
        return y.to(h.dtype)
