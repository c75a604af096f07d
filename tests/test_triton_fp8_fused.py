"""The FP8 GEMM that quantizes its activations inside the K loop
(pdserve.kernels.triton_fp8_fused), under the Triton interpreter on CPU (compiled on CUDA),
against the unfused path's torch references: per-token-and-block activations for block weights,
per-token for per-channel ones. Weight scales differ per block and per row by orders of
magnitude, and activation groups by 50x, so a scale from the wrong block or a group quantized
with the wrong amax moves the result far past the tolerance."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels import triton_quant
from pdserve.kernels.triton_fp8_fused import fp8_fused_matmul
from pdserve.kernels.triton_quant_scaled_mm import fp8_channel_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 128


def _weight(rows: int, cols: int, scale_cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight and per-row scales [rows, scale_cols] over 2^-6..2^5."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(rows, cols, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    exponents = torch.randperm(rows * scale_cols, generator=gen).reshape(rows, scale_cols) % 12 - 6
    return weight, torch.pow(2.0, exponents.float()) * (1 + torch.rand(rows, scale_cols, generator=gen))


def _activations(tokens: int, cols: int) -> torch.Tensor:
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens)) * 3
    x[:, :BLOCK] *= 50  # the first group's amax is far above the others'
    return x * torch.logspace(-1, 1, tokens).reshape(-1, 1)  # and each token's differs


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("tokens,rows,cols", [(1, 48, 384), (19, 80, 320)])
def test_block_weights_match_the_unfused_reference(tokens, rows, cols, split_k):
    weight, scale = _weight(rows, cols, -(-cols // BLOCK), seed=rows)
    x = _activations(tokens, cols)
    want = triton_quant.fp8_block_reference(x, weight, scale, BLOCK)
    got = fp8_fused_matmul(x.to(DEVICE), weight.view(torch.uint8).to(DEVICE), scale.to(DEVICE),
                           out_dtype=torch.float32, split_k=split_k).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("tokens,rows,cols", [(1, 32, 256), (5, 48, 200)])
def test_per_channel_weights_match_the_unfused_reference(tokens, rows, cols, split_k):
    """One activation group per token over all of K (200: not whole tiles of 128)."""
    weight, scale = _weight(rows, cols, 1, seed=rows)
    x = _activations(tokens, cols)
    want = fp8_channel_reference(x, weight, scale[:, 0])
    got = fp8_fused_matmul(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), out_dtype=torch.float32,
                           split_k=split_k).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_block_scales_of_another_width_are_refused():
    weight, scale = _weight(16, 256, 4, seed=1)  # 4 columns of scales: blocks of 64
    with pytest.raises(ValueError, match="one per 128"):
        fp8_fused_matmul(torch.randn(1, 256, device=DEVICE), weight.to(DEVICE), scale.to(DEVICE))
