"""A hybrid model offline at TP 1 against TP 2 on the same machine: bench_hybrid_offline's
random-weight shapes (Qwen3.5: Gated DeltaNet beside gated attention; Nemotron-H: Mamba2, MLP and
attention blocks), 32 requests of 32-256 prompt tokens, 32 new tokens each, greedy, ignore_eos.
The two degrees alternate (TP 1, TP 2, three times each); output tokens per second of one
generate over all requests, after a short warm-up generate; medians. Whether the two degrees
gave the same greedy tokens is printed too (under bf16 products the ranks' partial sums round in
another order, so near ties may go the other way; float32 products keep them).

    .venv/bin/python -m benchmarks.engine.bench_hybrid_tp --family qwen3_5_text
    PDSERVE_CPU_GEMM_DTYPE=float32 .venv/bin/python -m benchmarks.engine.bench_hybrid_tp --family nemotron_h
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.engine.bench_hybrid_offline import FAMILIES
from benchmarks.engine.offline_model_bench import build_model, workload
from pdserve import LLM, SamplingParams

REQUESTS, NEW_TOKENS = 32, 32


def run(path: Path, tp: int, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    llm = LLM(model=str(path), tensor_parallel_size=tp, num_kv_blocks=2048)
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return REQUESTS * NEW_TOKENS / (time.perf_counter() - start), [o.outputs[0].token_ids for o in outs]
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=["qwen3_5_text", "nemotron_h"], default="qwen3_5_text")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    architecture, config = FAMILIES[args.family]
    path, params = build_model(Path(tempfile.mkdtemp()) / args.family, args.family, architecture, config)
    prompts = workload(REQUESTS, 32, 256, config["vocab_size"])
    rates: dict[int, list[float]] = {1: [], 2: []}
    tokens: dict[int, list[list[int]]] = {}
    for _ in range(args.repeats):
        for tp in (1, 2):
            rate, tokens[tp] = run(path, tp, prompts)
            rates[tp].append(rate)
            print(f"TP {tp}: {rate:.1f} output tokens/s", flush=True)
    one, two = (statistics.median(rates[tp]) for tp in (1, 2))
    print(f"{args.family} ({params / 1e6:.0f}M): TP 1 {one:.1f}, TP 2 {two:.1f} tokens/s = {two / one:.2f}x; "
          f"same greedy tokens: {tokens[1] == tokens[2]}")


if __name__ == "__main__":
    main()
