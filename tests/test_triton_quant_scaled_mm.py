"""Per-channel and per-tensor FP8 through torch._scaled_mm (pdserve.kernels.triton_quant_scaled_mm):
the plain-torch reference against pdserve's CPU FP8 kernel, _scaled_mm's float32 epilogue on CPU
(torch 2.13 runs it there), and the bfloat16 row-wise path on CUDA only."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels import fp8_cpu
from pdserve.kernels.triton_quant_scaled_mm import channel_scale, fp8_channel_matmul, fp8_channel_reference
from pdserve.layers.quant.act_quant import fp8_quant_dequant


def _weight(rows: int, cols: int, per_tensor: bool):
    gen = torch.Generator().manual_seed(rows + per_tensor)
    weight = (torch.randn(rows, cols, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    # per-channel scales over 2^-6..2^5, so a scale on the wrong row shows
    scale = torch.tensor([0.03]) if per_tensor else torch.pow(2.0, (torch.randperm(rows, generator=gen) % 12 - 6).float())
    return weight, scale


def _activations(tokens: int, cols: int) -> torch.Tensor:
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
    return x * torch.logspace(-2, 2, tokens).reshape(-1, 1)  # per-token scales differ


@pytest.mark.parametrize("per_tensor", [False, True])
def test_reference_is_the_cpu_fp8_kernel(per_tensor):
    weight, scale = _weight(48, 96, per_tensor)
    x = _activations(5, 96)
    want = fp8_cpu.fp8_matmul(fp8_quant_dequant(x, 96), weight.view(torch.uint8),
                              channel_scale(scale, 48).t().contiguous(), 96)
    got = fp8_channel_reference(x, weight, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("per_tensor", [False, True])
def test_scaled_mm_float32_epilogue_on_cpu(per_tensor):
    weight, scale = _weight(48, 96, per_tensor)
    x = _activations(7, 96)
    want = fp8_channel_reference(x, weight, scale)
    got = fp8_channel_matmul(x, weight.view(torch.uint8), scale, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="row-wise _scaled_mm: CUDA only")
@pytest.mark.parametrize("per_tensor", [False, True])
def test_scaled_mm_rowwise_bf16_on_cuda(per_tensor):
    weight, scale = _weight(256, 512, per_tensor)
    x = _activations(33, 512)
    want = fp8_channel_reference(x, weight, scale)
    got = fp8_channel_matmul(x.cuda().bfloat16(), weight.cuda(), scale.cuda(), out_dtype=torch.bfloat16)
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS int8 GEMM: CUDA only")
def test_w8a8_layer_at_decode_batch_sizes_on_cuda():
    """torch._int_mm on CUDA takes more than 16 rows; a decode batch of 3 is padded."""
    from pdserve.layers.linear import ReplicatedLinear
    from pdserve.layers.quant.act_quant import Int8LinearMethod, scale_bits
    from pdserve.layers.quant.base import QuantConfig

    class _Int8(QuantConfig):
        def linear_method(self, layer, prefix):
            return Int8LinearMethod()

    layer = ReplicatedLinear(64, 32, quant_config=_Int8())
    layer.weight.data.copy_(torch.randint(-127, 128, (32, 64), dtype=torch.int8))
    layer.weight_scale.data = scale_bits(torch.rand(32, 1) + 0.5)
    x = torch.randn(3, 64)
    want = layer(x)
    torch.testing.assert_close(layer.cuda()(x.cuda()).cpu(), want, rtol=1e-5, atol=1e-4)
