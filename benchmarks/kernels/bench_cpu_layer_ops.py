"""The small per-layer ops of a CPU decode step at SmolLM2-135M's shapes, plain torch against
pdserve's compiled ones: residual add + RMSNorm, RoPE, SiLU * up (pdserve.kernels.numba_fused)
and the KV write (numba_ops.store_kv), and the Python around a quantized matmul (quant_matmul,
which builds the kernels' views on every call, against packed_matmul over views made once).

    .venv/bin/python -m benchmarks.kernels.bench_cpu_layer_ops [--tokens 1 8] [--rounds 5]

One thread. Each figure is the median over rounds of each round's median of 200 calls, in
microseconds; torch and compiled calls alternate round by round.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import torch
import torch.nn.functional as F

from pdserve.kernels import numba_fused, numba_ops, quant_cpu, torch_ops
from pdserve.models.llama import RMSNorm
from pdserve.models.rope import RotaryEmbedding

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 576, 9, 3, 64, 1536


def median_us(fn, calls: int = 200) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def cases(tokens: int) -> dict[str, tuple]:
    norm = RMSNorm(HIDDEN, 1e-5)
    x, delta = torch.randn(tokens, HIDDEN), torch.randn(tokens, HIDDEN)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q = qkv[:, :HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    cos, sin = torch.randn(tokens, 1, HEAD_DIM), torch.randn(tokens, 1, HEAD_DIM)
    gate_up = torch.randn(tokens, 2 * INTER)
    cache = torch.zeros(64, 30, 2, 16, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = cache[:, 7].unbind(1)
    slots = torch.arange(tokens) * 16 + 3
    qw = torch.randint(0, 256, (HIDDEN, HIDDEN // 2), dtype=torch.uint8)
    scales, mins = (torch.rand(HIDDEN, HIDDEN // 32) * 0.01).half(), (torch.randn(HIDDEN, HIDDEN // 32) * 0.01).half()
    packed = quant_cpu.PackedMatrix.of(4, qw, scales, mins, 32)
    return {
        "add + RMSNorm": (lambda: norm(x + delta), lambda: numba_fused.rms_norm(x, norm.weight, norm.eps, delta)),
        "RoPE (q and k)": (lambda: RotaryEmbedding.apply(q, k, cos, sin), lambda: numba_fused.rope_(q, k, cos, sin)),
        "SiLU * up": (lambda: F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:], lambda: numba_fused.silu_mul(gate_up)),
        "store_kv": (lambda: torch_ops.store_kv(k, k, k_cache, v_cache, slots),
                     lambda: numba_ops.store_kv(k, k, k_cache, v_cache, slots)),
        "o_proj 576x576 Q4_1 call": (lambda: quant_cpu.quant_matmul(x, 4, qw, scales, mins, 32),
                                     lambda: quant_cpu.packed_matmul(x, packed)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| op | tokens | torch / per-call views, us | compiled / views made once, us | ratio |")
    print("|---|---:|---:|---:|---:|")
    with torch.inference_mode():
        for tokens in args.tokens:
            for name, (old, new) in cases(tokens).items():
                olds, news = [], []
                for _ in range(args.rounds):
                    olds.append(median_us(old))
                    news.append(median_us(new))
                o, n = statistics.median(olds), statistics.median(news)
                print(f"| {name} | {tokens} | {o:.1f} | {n:.1f} | {o / n:.1f}x |")


if __name__ == "__main__":
    main()
