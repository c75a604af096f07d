"""FP8 block-scaled MoE experts in Triton (pdserve.kernels.triton_quant_moe) against their torch
reference and against pdserve's CPU experts (models.moe_quant.Fp8Experts), under the interpreter.
Scales differ per expert, row block and column block, and the intermediate size leaves a partial
column block, so a scale taken from the wrong expert or block shows."""
from __future__ import annotations

import torch

from pdserve.kernels.triton_quant_moe import fp8_experts_reference, fp8_fused_experts
from pdserve.layers.quant.act_quant import scale_bits
from pdserve.models.moe import silu_mul
from pdserve.models.moe_quant import Fp8Experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 128


def _fp8_expert_weights(experts: int, rows: int, cols: int, gen: torch.Generator):
    """e4m3 bytes [E, rows, cols] and per-row scales [E, rows, ceil(cols / BLOCK)] that repeat
    down each 128-row block, over 2^-6..2^5."""
    weight = (torch.randn(experts, rows, cols, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    row_blocks, col_blocks = -(-rows // BLOCK), -(-cols // BLOCK)
    exponents = torch.randperm(experts * row_blocks * col_blocks, generator=gen) % 12 - 6
    scale = torch.pow(2.0, exponents.float()).reshape(experts, row_blocks, col_blocks) / 64
    return weight.view(torch.uint8), scale.repeat_interleave(BLOCK, 1)[:, :rows].contiguous()


def test_fp8_experts_match_reference_and_cpu_experts():
    gen = torch.Generator().manual_seed(0)
    num_experts, hidden, intermediate, tokens, top_k = 4, 256, 192, 9, 2
    experts = Fp8Experts(num_experts, hidden, intermediate, BLOCK)
    gate_up, gate_up_scale = _fp8_expert_weights(num_experts, 2 * intermediate, hidden, gen)
    down, down_scale = _fp8_expert_weights(num_experts, hidden, intermediate, gen)
    for name, value in (("gate_up_proj", gate_up), ("down_proj", down)):
        getattr(experts, name).data.copy_(value)
    experts.gate_up_scale.data = scale_bits(gate_up_scale)
    experts.down_scale.data = scale_bits(down_scale)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    args = (gate_up, gate_up_scale, down, down_scale, BLOCK, silu_mul)
    want = fp8_experts_reference(x, ids, weights, *args)
    cpu = experts(x, ids, weights)
    got = fp8_fused_experts(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE),
                            *(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)).cpu()
    scale = want.abs().max().item()
    torch.testing.assert_close(cpu, want, rtol=1e-4, atol=1e-5 * scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)
