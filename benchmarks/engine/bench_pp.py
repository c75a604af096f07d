"""Pipeline parallelism on CPU: PP 2 (two processes, one thread each, the layers split in two)
against PP 1 (one process, two threads), same run, on bench_offline.py's model and workload
(support/bench_model.py: 64 requests, prompts of 32-512 tokens, 64 new tokens each). Reports
output tokens/s (median of --repeats) and each stage's idle share: the part of the run its
process spent off the CPU (1 - its CPU time / the run's wall time; one thread a stage, so CPU
time is the time it computed), and the driver's time waiting for the last stage's logits:

    .venv/bin/python -m benchmarks.engine.bench_pp --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.engine.bench_tp import weight_bytes
from benchmarks.support.bench_model import BLOCK_TOKENS, KV_BLOCKS, build_model, workload


def _cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def run(path: Path, prompts, new_tokens: int, pp: int) -> dict:
    import torch

    from pdserve import LLM, SamplingParams
    torch.set_num_threads(2)
    llm = LLM(model=str(path), num_kv_blocks=KV_BLOCKS, block_size=BLOCK_TOKENS, pipeline_parallel_size=pp,
              threads_per_rank=2 // pp)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], params, use_tqdm=False)  # warm-up
    pids = [psutil.Process().pid] + ([w.pid for w in llm.engine.executor.workers] if pp > 1 else [])
    cpu0 = [_cpu_seconds(pid) for pid in pids]
    link = getattr(llm.engine.runner, "link", None)
    wait0 = link.wait_seconds if link is not None else 0.0
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    busy = [(_cpu_seconds(pid) - c) / elapsed for pid, c in zip(pids, cpu0)]
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"tok_s": produced / elapsed, "weights": weight_bytes(llm.engine.model),
              "idle0": 1 - busy[0] if pp > 1 else 0.0, "idle1": 1 - busy[1] if pp > 1 else 0.0,
              "wait0": ((link.wait_seconds - wait0) / elapsed) if link is not None else 0.0}
    llm.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = build_model(Path(tempfile.mkdtemp()) / "llama-32m")
    prompts = workload(args.requests, 32, 512)
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for r in range(args.repeats):
        for pp in (1, 2):
            runs[pp].append(run(path, prompts, args.new_tokens, pp))
        last = runs[2][-1]
        print(f"run {r + 1}: PP1 {runs[1][-1]['tok_s']:.1f} tok/s, PP2 {last['tok_s']:.1f} tok/s (idle: stage 0 "
              f"{last['idle0']:.0%}, stage 1 {last['idle1']:.0%}; driver waiting for logits {last['wait0']:.0%})",
              flush=True)
    med = {pp: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for pp, rs in runs.items()}
    print("\n| | PP 1 (2 threads) | PP 2 (1 thread per stage) |\n|---|---:|---:|")
    print(f"| output tokens/s (median of {args.repeats}) | {med[1]['tok_s']:.1f} | {med[2]['tok_s']:.1f} "
          f"({med[2]['tok_s'] / med[1]['tok_s']:.2f}x) |")
    print(f"| stage 0 idle (the driver: off the CPU) | | {med[2]['idle0']:.0%} |")
    print(f"| stage 1 idle (off the CPU) | | {med[2]['idle1']:.0%} |")
    print(f"| driver waiting for the last stage | | {med[2]['wait0']:.0%} |")
    print(f"| weight bytes per stage | {med[1]['weights'] / 2**20:.1f} MiB | {med[2]['weights'] / 2**20:.1f} MiB "
          f"(stage 0) |")


if __name__ == "__main__":
    main()
