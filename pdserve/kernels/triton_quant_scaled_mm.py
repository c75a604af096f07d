"""Per-channel and per-tensor FP8 weights on CUDA through torch._scaled_mm (cuBLASLt's FP8
GEMM), beside the Triton kernels of triton_quant: with one weight scale per row there is nothing
for a Triton kernel to do inside the K loop, and cuBLASLt's FP8 path is the fastest there is.

Activations are quantized per token on the fly (act_quant's scheme with one group per token:
s = max(amax, 1e-10) / 448, x_q = e4m3(clamp(x / s))). Two epilogues:
- bfloat16 output: both scales inside the GEMM (row-wise scaling, scale_a [M, 1], scale_b [1, N]);
- float32 output (greedy exactness checks): unit scales and float32 output from the GEMM, the two
  scales multiplied after, since row-wise scaling only writes bfloat16 (on CPU; on CUDA the
  plain-torch reference, see fp8_channel_matmul).
torch._scaled_mm also runs on CPU in torch 2.13 (slowly), which is how the CPU tests call it.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
AMAX_FLOOR = 1e-10
ALIGN = 16  # _scaled_mm wants K and N multiples of 16


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q float8_e4m3fn [M, K], scale float32 [M, 1])."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def channel_scale(weight_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A per-tensor ([1] or [1, 1]) or per-channel ([N] or [N, 1]) weight scale -> float32 [1, N]."""
    return weight_scale.float().reshape(1, -1).expand(1, rows).contiguous()


def scaled_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.shape[1] % ALIGN == 0 and weight.shape[0] % ALIGN == 0


def fp8_channel_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ (weight * scale).T -> [M, N]; weight [N, K] float8_e4m3fn (or its bytes, uint8),
    weight_scale per tensor or per channel. Shapes _scaled_mm cannot take go through the reference."""
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    out_dtype = out_dtype or x.dtype
    # float32 output on CUDA (the exactness checks) takes the reference: _scaled_mm's float32
    # epilogue there was 2% off it on an H200 (docs/gpu.md), where the CPU's matches to 1e-5
    if not scaled_mm_supported(x, weight) or (x.is_cuda and out_dtype == torch.float32):
        return fp8_channel_reference(x, weight, weight_scale).to(out_dtype)
    xq, x_scale = per_token_quant_fp8(x)
    w_scale = channel_scale(weight_scale, weight.shape[0])
    if out_dtype == torch.bfloat16:
        return torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    y = torch._scaled_mm(xq, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return (y * x_scale * w_scale).to(out_dtype)


def fp8_channel_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The same math in plain float32 torch: dequantized activations times dequantized weights."""
    xq, x_scale = per_token_quant_fp8(x)
    w = weight.view(torch.float8_e4m3fn).float() * channel_scale(weight_scale, weight.shape[0]).t()
    return (xq.float() * x_scale) @ w.t()
