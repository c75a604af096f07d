"""Per-shape timing of the matmuls for checkpoints that quantize activations (FP8 and W8A8) on
SmolLM2-135M's shapes, against float32 F.linear, each including its activation quantization:

- FP8 (e4m3 weights, per-channel scales, dynamic per-token FP8 activations): pdserve's numba
  kernel (pdserve.kernels.fp8_cpu: gemv up to 16 tokens, tiles + BLAS above), and
  torch._scaled_mm with row-wise scales (runs on CPU in torch 2.13);
- int8 (per-channel weights, dynamic per-token int8 activations): torch._int_mm (int32 sums)
  and torch._weight_int8pack_mm on the dequantized activations.

The fastest of --repeats runs (a shared machine loses whole time slices; the minimum filters
them out):

    .venv/bin/python -m benchmarks.kernels.bench_act_quant_matmul --threads 1
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pdserve.kernels import fp8_cpu
from pdserve.layers.quant.act_quant import FP8_MAX, fp8_quant_dequant, int8_quantize

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def fastest_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def _scaled_mm(x: torch.Tensor, w_fp8_t: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch._scaled_mm(q, w_fp8_t, scale_a=scale, scale_b=w_scale, out_dtype=torch.float32)


def _int_mm(x: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    q, scale = int8_quantize(x)
    return torch._int_mm(q, w_int8.t()).float() * scale * w_scale


def _int8pack(x: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    q, scale = int8_quantize(x)
    return torch._weight_int8pack_mm(q.float() * scale, w_int8, w_scale[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    r = args.repeats
    print(f"{'shape':8} {'T':>3} {'fp32':>8} {'fp8 numba':>10} {'_scaled_mm':>10} {'_int_mm':>8} "
          f"{'int8pack':>8}  (ms)")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.05
        w_scale = w.abs().amax(-1, keepdim=True) / FP8_MAX
        w_fp8 = (w / w_scale).to(torch.float8_e4m3fn)
        w_u8, scales = w_fp8.view(torch.uint8), w_scale.contiguous()
        i_scale = w.abs().amax(-1, keepdim=True) / 127
        w_int8 = (w / i_scale).round().to(torch.int8)
        for tokens in (1, 4, 16, 64):
            x = torch.randn(tokens, k)
            row = [fastest_ms(lambda: F.linear(x, w), r),
                   fastest_ms(lambda: fp8_cpu.fp8_matmul(fp8_quant_dequant(x, k), w_u8, scales, k), r),
                   fastest_ms(lambda: _scaled_mm(x, w_fp8.t(), w_scale.reshape(1, -1)), r),
                   fastest_ms(lambda: _int_mm(x, w_int8, i_scale.reshape(1, -1)), r),
                   fastest_ms(lambda: _int8pack(x, w_int8, i_scale.reshape(1, -1)), r)]
            print(f"{name:8} {tokens:>3} {row[0]:8.3f} {row[1]:10.3f} {row[2]:10.3f} {row[3]:8.3f} {row[4]:8.3f}")


if __name__ == "__main__":
    main()
