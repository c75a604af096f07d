"""The compiled quantized matmul (pdserve/kernels/native_gemv.c) beside the kernels it replaces, on
SmolLM2-135M's Q4_1 shapes (and its Q8_0 LM head), in one run: numba's gemv (quant_gemv), the
dequantize-tiles-then-BLAS matmul, and the compiled kernel, at decode-sized token counts.

    .venv/bin/python -m benchmarks.kernels.bench_native_gemv [--tokens 1 8 16 32] [--threads 2]

Prints the median microseconds a call over --repeats timings and the ratio numba / native. The
machine is shared: the three kernels are timed in turn within each repeat.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

SHAPES = [  # name, rows, columns, bits, has_min (SmolLM2's Q4_1 file: layers Q4_1, LM head Q8_0)
    ("qkv_proj", 960, 576, 4, True), ("o_proj", 576, 576, 4, True), ("gate_up_proj", 3072, 576, 4, True),
    ("down_proj", 576, 1536, 4, True), ("lm_head", 49152, 576, 8, False)]


def _matrix(rng, rows, cols, bits, has_min):
    import numpy as np
    import torch
    q = torch.from_numpy(rng.integers(0, 256, (rows, cols // 2 if bits == 4 else cols), dtype=np.uint8))
    scales = torch.from_numpy(rng.random((rows, cols // 32), dtype=np.float32) * 0.01).half()
    mins = -torch.from_numpy(rng.random((rows, cols // 32), dtype=np.float32) * 0.01).half() if has_min else None
    return (q if bits == 4 else q.view(torch.int8)), scales, mins


def _time(fn, calls: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    os.environ.update(OMP_NUM_THREADS=str(args.threads), NUMBA_NUM_THREADS=str(args.threads))
    import numpy as np
    import torch

    from pdserve.kernels import native_gemv, quant_cpu
    torch.set_num_threads(args.threads)
    if native_gemv.library() is None:
        raise SystemExit("the compiled kernel is unavailable here (see the log line above)")
    rng = np.random.default_rng(0)
    print(f"{'tokens':>6} {'matrix':>13} {'numba us':>9} {'tiles+BLAS us':>13} {'native us':>9} {'numba/native':>12}"
          f" {'no panels us':>15} {'no panels/native':>14}")
    for name, rows, cols, bits, has_min in SHAPES:
        q, scales, mins = _matrix(rng, rows, cols, bits, has_min)
        m = quant_cpu.PackedMatrix.of(bits, q, scales, mins, 32)
        for tokens in args.tokens:
            x = torch.randn(tokens, cols)
            kernels = {"numba": lambda: quant_cpu._gemv(x, m), "tiles": lambda: quant_cpu._tiled(x, m),
                       "native": lambda: quant_cpu.packed_matmul(x, m), "no panels": lambda: _no_panels(x, m)}
            calls = max(2, int(20000 / (rows * cols / 1e4) / max(1, tokens) ** 0.5))
            times = {k: [] for k in kernels}
            for _ in range(args.repeats):
                for k, fn in kernels.items():
                    times[k].append(_time(fn, calls))
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"{tokens:>6} {name:>13} {med['numba']:>9.1f} {med['tiles']:>13.1f} {med['native']:>9.1f} "
                  f"{med['numba'] / med['native']:>11.2f}x {med['no panels']:>15.1f} "
                  f"{med['no panels'] / med['native']:>14.2f}x")


def _no_panels(x, m):
    """The compiled kernel with native_gemv_panels.c's micro-kernel off (AVX2 builds: the tiles)."""
    from pdserve.kernels import native_gemv, quant_cpu
    before = native_gemv.set_panels_min_tokens(1 << 30)
    try:
        return quant_cpu.packed_matmul(x, m)
    finally:
        native_gemv.set_panels_min_tokens(before)


if __name__ == "__main__":
    main()
