"""The quantized Triton GEMMs (pdserve.kernels.triton_quant) against their torch references and
against pdserve's CPU kernels, under the Triton interpreter on CPU (compiled on CUDA).

Scales differ per block and per group by orders of magnitude, so a scale read from the wrong
block, or a min off by one group, moves the result far past the tolerance."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kernels import fp8_cpu, quant_cpu, triton_quant
from pdserve.layers.linear import ReplicatedLinear
from pdserve.layers.quant import cuda_kernels
from pdserve.layers.quant.act_quant import Fp8LinearMethod, expand_scale, fp8_quant_dequant, scale_bits
from pdserve.layers.quant.base import QuantConfig
from pdserve.layers.quant.gptq_awq import PermutedGroupedMethod
from pdserve.layers.quant.grouped import GroupedLinearMethod, GroupedWeight, GroupFormat, scales_view

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fp8_weight(rows: int, cols: int, block: int, seed: int):
    """An e4m3 weight and its block scales [ceil(rows / block), ceil(cols / block)], spread over
    powers of two from 2^-6 to 2^5 so no two neighbouring blocks share a scale."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(rows, cols, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    blocks = (-(-rows // block), -(-cols // block))
    exponents = torch.randperm(blocks[0] * blocks[1], generator=gen).reshape(blocks) % 12 - 6
    return weight, torch.pow(2.0, exponents.float()) * (1 + torch.rand(blocks, generator=gen))


@pytest.mark.parametrize("tokens,rows,cols", [(1, 48, 256), (19, 160, 320)])
def test_fp8_block_matches_reference_and_cpu_kernel(tokens, rows, cols):
    block = 128  # 320 columns: a last block of 64
    weight, block_scale = _fp8_weight(rows, cols, block, seed=tokens)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(7)) * 3
    x[:, :block] *= 50  # per-group activation scales differ too
    want = triton_quant.fp8_block_reference(x, weight, block_scale, block, scale_row_block=block)
    got = triton_quant.fp8_block_matmul(x.to(DEVICE), weight.to(DEVICE), block_scale.to(DEVICE), block,
                                        scale_row_block=block, out_dtype=torch.float32).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # pdserve's layer layout: block scales repeated down the rows, the weight as its bytes
    per_row = block_scale.repeat_interleave(block, 0)[:rows].contiguous()
    got_rows = triton_quant.fp8_block_matmul(x.to(DEVICE), weight.view(torch.uint8).to(DEVICE),
                                             per_row.to(DEVICE), block, out_dtype=torch.float32).cpu()
    torch.testing.assert_close(got_rows, got, rtol=0, atol=0)
    cpu = fp8_cpu.fp8_matmul(fp8_quant_dequant(x, block), weight.view(torch.uint8), per_row, block)
    torch.testing.assert_close(got, cpu, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _grouped_weight(rows: int, cols: int, bits: int, group: int, half: bool, has_min: bool, seed: int):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (rows, cols)) if bits == 4 else rng.integers(-128, 128, (rows, cols))
    groups = cols // group
    # scales spread over 2^-8..2^3 per group; mins negative and also per group
    scales = np.exp2(rng.permutation(rows * groups).reshape(rows, groups) % 12 - 8) * rng.uniform(1, 2, (rows, groups))
    dtype = np.float16 if half else np.float32
    mins = -rng.uniform(0.5, 8, (rows, groups)) * scales if has_min else None
    weight = GroupedWeight(q.astype(np.uint8 if bits == 4 else np.int8), scales.astype(dtype),
                           None if mins is None else mins.astype(dtype), group, bits)
    params = weight.to_params(weight.native_format())
    return (params["qweight"], scales_view(params["scales"]),
            scales_view(params["mins"]) if has_min else None)


GROUPED_CASES = [  # bits, group, half scales, has_min, tokens, split_k
    (4, 32, True, False, 1, 1),
    (4, 32, True, True, 3, 4),
    (4, 128, False, True, 20, 1),
    (4, 16, False, False, 2, 3),
    (8, 32, True, False, 5, 2),
]


@pytest.mark.parametrize("bits,group,half,has_min,tokens,split_k", GROUPED_CASES)
def test_grouped_matches_reference_and_cpu_kernel(bits, group, half, has_min, tokens, split_k):
    rows, cols = 80, 256
    q, scales, mins = _grouped_weight(rows, cols, bits, group, half, has_min, seed=group + tokens)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(3))
    want = triton_quant.grouped_reference(x, q, scales, mins, bits, group)
    dequant = quant_cpu.dequantize_rows(bits, q, scales, mins, group)
    torch.testing.assert_close(triton_quant.grouped_dequantize(q, scales, mins, bits, group), dequant,
                               rtol=0, atol=0)
    got = triton_quant.grouped_matmul(x.to(DEVICE), q.to(DEVICE), scales.to(DEVICE),
                                      None if mins is None else mins.to(DEVICE), bits, group, split_k).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bfloat16 tl.dot: CUDA only")
def test_grouped_bf16_activations():
    q, scales, mins = _grouped_weight(128, 512, 4, 32, True, True, seed=11)
    x = torch.randn(64, 512, device="cuda").bfloat16()
    got = triton_quant.grouped_matmul(x, q.cuda(), scales.cuda(), mins.cuda(), 4, 32)
    want = triton_quant.grouped_reference(x.float(), q.cuda(), scales.cuda(), mins.cuda(), 4, 32)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


class _Method(QuantConfig):
    def __init__(self, method):
        self.method = method

    def linear_method(self, layer, prefix):
        return self.method


def _layers_apply_both_ways(layer, x, monkeypatch):
    """(the CPU path's output, the CUDA path's: on the GPU where there is one, else forced on CPU
    through the interpreter)."""
    cpu = layer(x)
    if torch.cuda.is_available():
        return cpu, layer.cuda()(x.cuda()).cpu()
    monkeypatch.setattr(cuda_kernels, "runs_triton", lambda t: True)
    return cpu, layer(x)


@pytest.mark.parametrize("block", [128, 0])
def test_fp8_layer_cuda_path_matches_cpu_path(block, monkeypatch):
    rows, cols = 80, 256
    weight, block_scale = _fp8_weight(rows, cols, block or cols, seed=5)
    layer = ReplicatedLinear(cols, rows, quant_config=_Method(Fp8LinearMethod(block)))
    layer.weight.data.copy_(weight.view(torch.uint8))
    per_row = expand_scale(block_scale[:, :1] if not block else block_scale, rows, block or cols)
    layer.weight_scale.data = scale_bits(per_row)
    x = torch.randn(2, 3, cols, generator=torch.Generator().manual_seed(1))
    cpu, cuda_path = _layers_apply_both_ways(layer, x, monkeypatch)
    torch.testing.assert_close(cuda_path, cpu, rtol=1e-5, atol=1e-5 * cpu.abs().max().item())


@pytest.mark.parametrize("method", [GroupedLinearMethod, PermutedGroupedMethod])
def test_grouped_layer_cuda_path_matches_cpu_path(method, monkeypatch):
    """Plain, and GPTQ desc_act's (columns sorted by group, the input permuted to match)."""
    rows, cols, fmt = 64, 128, GroupFormat(4, 32, True, True)
    q, scales, mins = _grouped_weight(rows, cols, 4, 32, True, True, seed=9)
    layer = ReplicatedLinear(cols, rows, bias=True, quant_config=_Method(method(fmt)))
    if method is PermutedGroupedMethod:
        layer.perm.data.copy_(torch.randperm(cols, generator=torch.Generator().manual_seed(4)))
    layer.qweight.data.copy_(q)
    layer.scales.data.copy_(scales.view(torch.int16))
    layer.mins.data.copy_(mins.view(torch.int16))
    layer.bias.data.normal_()
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(2))
    cpu, cuda_path = _layers_apply_both_ways(layer, x, monkeypatch)
    torch.testing.assert_close(cuda_path, cpu, rtol=1e-5, atol=1e-5 * cpu.abs().max().item())
