"""Per-shape timing of pdserve's quantized CPU matmuls against float32 F.linear (SmolLM2-135M's
shapes): the fused gemv kernel, tiled dequantize + BLAS, and, for int4, torch's own
_weight_int4pack_mm_for_cpu. The fastest of --repeats runs: on a shared machine a parallel
kernel loses whole scheduler time slices, which the minimum filters out. Run on one thread for
figures that other tenants disturb least:

    NUMBA_NUM_THREADS=1 .venv/bin/python -m benchmarks.kernels.bench_quant_matmul --threads 1
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pdserve.kernels import quant_cpu

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


REPEATS = 15


def fastest_ms(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def main() -> None:
    global REPEATS
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--repeats", type=int, default=REPEATS)
    args = ap.parse_args()
    REPEATS = args.repeats
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{'shape':8} {'T':>3} {'bits':>4} {'fp32':>8} {'gemv':>8} {'tiled':>8} {'int4pack':>8}  (ms)")
    for name, (n, k) in SHAPES.items():
        bits = 8 if name == "lm_head" else 4
        q = (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8) if bits == 4
             else torch.randint(-128, 128, (n, k), dtype=torch.int8))
        scales = (torch.rand(n, k // 32) * 0.01).half()
        mins = (torch.randn(n, k // 32) * 0.01).half() if bits == 4 else None
        w = quant_cpu.dequantize_rows(bits, q, scales, mins, 32)
        packed = None
        if bits == 4:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
            sz = torch.randn(k // 32, n, 2)
        for tokens in (1, 4, 8, 16, 32, 64):
            x = torch.randn(tokens, k)
            row = [fastest_ms(lambda: F.linear(x, w)),
                   fastest_ms(lambda: quant_cpu.gemv(x, bits, q, scales, mins, 32)),
                   fastest_ms(lambda: quant_cpu.tiled_matmul(x, bits, q, scales, mins, 32))]
            row.append(fastest_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz))
                       if packed is not None else float("nan"))
            print(f"{name:8} {tokens:>3} {bits:>4} " + " ".join(f"{v:8.3f}" for v in row))


if __name__ == "__main__":
    main()
