"""Old against new, in one run: the quantized CPU matmul at SmolLM2-135M's Q4_1/Q8_0 shapes, and
optionally the whole decode step (benchmarks/engine/profile_quant_decode.py), for a baseline checkout and
this one. Runs alternate (baseline, this, baseline, this, ...), each in a fresh process, and the
medians over rounds are reported, so that a shared machine's load falls on both alike.

    git archive <commit> pdserve | tar -x -C /tmp/base
    .venv/bin/python -m benchmarks.kernels.bench_quant_ab --baseline /tmp/base --rounds 5 [--profile]

Each kernel figure is one process's fastest (--statistic median: median) of --repeats calls, in
ms; each profile figure is one process's median decode step and part (one request, 128-token
prompt, 32 new tokens). The table gives the median over rounds of each.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]  # this checkout
SHAPES = {"qkv": (960, 576, 4), "o": (576, 576, 4), "gate_up": (3072, 576, 4), "down": (576, 1536, 4),
          "lm_head": (49152, 576, 8)}

KERNEL_CODE = """
import json, statistics, sys, time, torch
from pdserve.kernels import quant_cpu
shapes, tokens_list, repeats, statistic = json.loads(sys.argv[1])
torch.manual_seed(0)
result = {}
for name, (n, k, bits) in shapes.items():
    q = (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8) if bits == 4
         else torch.randint(-128, 128, (n, k), dtype=torch.int8))
    scales = (torch.rand(n, k // 32) * 0.01).half()
    mins = (torch.randn(n, k // 32) * 0.01).half() if bits == 4 else None
    for tokens in tokens_list:
        x = torch.randn(tokens, k)
        quant_cpu.quant_matmul(x, bits, q, scales, mins, 32)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            quant_cpu.quant_matmul(x, bits, q, scales, mins, 32)
            times.append((time.perf_counter() - t0) * 1e3)
        result[f"{name} T={tokens}"] = min(times) if statistic == "min" else statistics.median(times)
print(json.dumps(result))
"""


def run_kernels(root: Path, args) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(root), NUMBA_NUM_THREADS=str(args.threads),
               OMP_NUM_THREADS=str(args.threads))
    spec = json.dumps([SHAPES, args.tokens, args.repeats, args.statistic])
    out = subprocess.run([sys.executable, "-c", KERNEL_CODE, spec], env=env, check=True, capture_output=True,
                         text=True, cwd=root).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_profile(root: Path, args) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(root))
    # By path, not -m: the script imports only pdserve, and it must be root's pdserve (PYTHONPATH).
    cmd = [sys.executable, str(HERE / "benchmarks" / "engine" / "profile_quant_decode.py"), "--threads",
           str(args.threads), "--new-tokens", "32"]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=root).stdout
    parts = {}
    for line in out.splitlines():
        cells = line.rsplit(None, 3)
        if len(cells) == 4 and cells[1].replace(".", "").isdigit():
            parts[cells[0].strip()] = float(cells[1])
    return parts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout holding the baseline's pdserve/")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--statistic", choices=("min", "median"), default="min",
                    help="each process's kernel figure: the fastest of its calls (the least disturbed by other "
                         "tenants of a loaded machine) or their median")
    ap.add_argument("--profile", action="store_true", help="also the whole decode step, per part")
    args = ap.parse_args()
    runs: dict[str, dict[str, list[float]]] = {"baseline": {}, "this": {}}
    for _ in range(args.rounds):
        for label, root in (("baseline", args.baseline.resolve()), ("this", HERE)):
            figures = run_kernels(root, args)
            if args.profile:
                figures.update({f"step: {k}": v for k, v in run_profile(root, args).items()})
            for key, value in figures.items():
                runs[label].setdefault(key, []).append(value)
    print(f"medians of {args.rounds} alternating rounds, {args.threads} thread(s), kernels: {args.statistic} "
          f"of {args.repeats} calls, ms")
    print(f"| {'what':<32} | baseline | this | baseline / this |")
    print("|---|---:|---:|---:|")
    for key, base in runs["baseline"].items():
        b, t = statistics.median(base), statistics.median(runs["this"].get(key, [float("nan")]))
        print(f"| {key:<32} | {b:.3f} | {t:.3f} | {b / t:.2f}x |")


if __name__ == "__main__":
    main()
