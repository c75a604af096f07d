"""MXFP4 MoE experts in Triton (pdserve.kernels.triton_quant_mxfp4) against their torch reference
and pdserve's CPU experts (models.moe_quant.Mxfp4Experts), under the interpreter. Every e2m1
code occurs, and the group scales differ per expert, row and 32 columns (2^-4..2^3), so a
nibble read in the wrong order or a scale from the wrong group shows."""
from __future__ import annotations

import torch

from pdserve.kernels.triton_quant_mxfp4 import mxfp4_experts_reference, mxfp4_fused_experts
from pdserve.models.moe import silu_mul
from pdserve.models.moe_quant import Mxfp4Experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_mxfp4_experts_match_reference_and_cpu_experts():
    gen = torch.Generator().manual_seed(0)
    num_experts, hidden, intermediate, tokens, top_k = 4, 96, 64, 7, 2
    experts = Mxfp4Experts(num_experts, hidden, intermediate, bias=True)
    params = {}
    for name, (rows, cols) in (("gate_up", (2 * intermediate, hidden)), ("down", (hidden, intermediate))):
        params[f"{name}_proj"] = torch.randint(0, 256, (num_experts, rows, cols // 2), generator=gen, dtype=torch.uint8)
        params[f"{name}_scale"] = torch.randint(123, 131, (num_experts, rows, cols // 32), generator=gen,
                                                dtype=torch.uint8)
        params[f"{name}_bias"] = torch.randn(num_experts, rows, generator=gen)
    for name, value in params.items():
        getattr(experts, name).data.copy_(value)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    args = (params["gate_up_proj"], params["gate_up_scale"], params["down_proj"], params["down_scale"], silu_mul,
            params["gate_up_bias"], params["down_bias"])
    want = mxfp4_experts_reference(x, ids, weights, *args)
    cpu = experts(x, ids, weights)
    got = mxfp4_fused_experts(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE),
                              *(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)).cpu()
    scale = want.abs().max().item()
    torch.testing.assert_close(cpu, want, rtol=1e-4, atol=1e-5 * scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)
