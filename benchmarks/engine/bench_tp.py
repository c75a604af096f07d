"""Tensor parallelism on CPU: TP 2 (two processes, one thread each) against TP 1 (one process,
two threads), same run, on bench_offline.py's model and workload (support/bench_model.py: 64
requests, prompts of 32-512 tokens, 64 new tokens each). Reports output tokens/s (median of
--repeats), the time per step spent in collectives and in sending the step's inputs (rank 0's
view), and each rank's weight bytes against TP 1. --step-inputs broadcast sends the step arrays by a gloo broadcast
instead of shared memory (the measurement behind the default):

    .venv/bin/python -m benchmarks.engine.bench_tp --repeats 3
    .venv/bin/python -m benchmarks.engine.bench_tp --repeats 3 --step-inputs broadcast
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.support.bench_model import BLOCK_TOKENS, KV_BLOCKS, build_model, workload


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def run(path: Path, prompts, new_tokens: int, tp: int) -> dict:
    import torch

    from pdserve import LLM, SamplingParams
    torch.set_num_threads(2)
    llm = LLM(model=str(path), num_kv_blocks=KV_BLOCKS, block_size=BLOCK_TOKENS, tensor_parallel_size=tp,
              threads_per_rank=2 // tp)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], params, use_tqdm=False)  # warm-up
    runner = llm.engine.runner
    group = llm.engine.executor.group if tp > 1 else None
    steps0, send0 = getattr(runner, "steps", 0), getattr(runner, "send_seconds", 0.0)
    comm0 = group.seconds[0] if group is not None else 0.0
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"tok_s": produced / elapsed, "weights": weight_bytes(llm.engine.model), "comm_ms": 0.0, "send_ms": 0.0}
    if tp > 1:
        steps = runner.steps - steps0
        result["comm_ms"] = (group.seconds[0] - comm0) / steps * 1e3
        result["send_ms"] = (runner.send_seconds - send0) / steps * 1e3
        result["step_ms"] = elapsed / steps * 1e3
    llm.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-inputs", choices=["shm", "broadcast"], default="shm")
    ap.add_argument("--collectives", choices=["shm", "gloo"], default="shm")
    args = ap.parse_args()
    os.environ["PDSERVE_TP_STEP_INPUTS"] = args.step_inputs
    os.environ["PDSERVE_TP_COLLECTIVES"] = args.collectives
    path = build_model(Path(tempfile.mkdtemp()) / "llama-32m")
    prompts = workload(args.requests, 32, 512)
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for r in range(args.repeats):
        for tp in (1, 2):
            runs[tp].append(run(path, prompts, args.new_tokens, tp))
        print(f"run {r + 1}: TP1 {runs[1][-1]['tok_s']:.1f} tok/s, TP2 {runs[2][-1]['tok_s']:.1f} tok/s "
              f"(step {runs[2][-1]['step_ms']:.1f} ms, collectives {runs[2][-1]['comm_ms']:.2f} ms, "
              f"inputs {runs[2][-1]['send_ms']:.3f} ms)", flush=True)
    med = {tp: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for tp, rs in runs.items()}
    print("\n| | TP 1 (2 threads) | TP 2 (1 thread per rank) |\n|---|---:|---:|")
    print(f"| output tokens/s (median of {args.repeats}) | {med[1]['tok_s']:.1f} | {med[2]['tok_s']:.1f} "
          f"({med[2]['tok_s'] / med[1]['tok_s']:.2f}x) |")
    print(f"| time per step | | {med[2]['step_ms']:.1f} ms |")
    print(f"| in collectives per step (rank 0) | | {med[2]['comm_ms']:.2f} ms |")
    print(f"| sending the step's inputs ({args.step_inputs}) per step | | {med[2]['send_ms']:.3f} ms |")
    print(f"| weight bytes per rank | {med[1]['weights'] / 2**20:.1f} MiB | {med[2]['weights'] / 2**20:.1f} MiB "
          f"({med[2]['weights'] / med[1]['weights']:.2f}x) |")


if __name__ == "__main__":
    main()
