"""Pipeline parallelism on CPU: PP 2 (two processes, one thread each, the layers split in two)
against PP 1 (one process, two threads), same run, on bench_offline.py's model and workload
(support/bench_model.py: 64 requests, prompts of 32-512 tokens, 64 new tokens each). Reports
output tokens/s (median of --repeats) and each stage's idle share: the part of the run it spent
waiting, stage 0 (the driver) for the last stage's logits, stage 1 for its next step or for
stage 0's hidden states (the driver's scheduling and sampling count as stage 0's work). PP 2
runs once per --variants entry S:M: S steps in flight at once (2, the default: the engine
launches the next step before the last one's results are back) and each step in M micro-batches
(1, the default: whole):

    .venv/bin/python -m benchmarks.engine.bench_pp --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.engine.bench_tp import weight_bytes
from benchmarks.support.bench_model import BLOCK_TOKENS, KV_BLOCKS, build_model, workload


def run(path: Path, prompts, new_tokens: int, pp: int, variant: tuple[int, int] = (1, 1)) -> dict:
    import torch

    from pdserve import LLM, SamplingParams
    torch.set_num_threads(2)
    llm = LLM(model=str(path), num_kv_blocks=KV_BLOCKS, block_size=BLOCK_TOKENS, pipeline_parallel_size=pp,
              threads_per_rank=2 // pp)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    if pp > 1:
        steps, llm.engine.runner.micro_batches = variant
        llm.engine.runner.steps_in_flight = llm.engine.scheduler.steps_in_flight = steps
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], params, use_tqdm=False)  # warm-up
    waits0 = _waits(llm, pp)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    idle = [(after - before) / elapsed for before, after in zip(waits0, _waits(llm, pp))]
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"tok_s": produced / elapsed, "weights": weight_bytes(llm.engine.model),
              "idle0": idle[0] if pp > 1 else 0.0, "idle1": idle[1] if pp > 1 else 0.0}
    llm.close()
    return result


def _waits(llm, pp: int) -> list[float]:
    """Seconds each stage has waited so far: the driver for the last stage's logits, the worker
    for its next step or for the hidden states."""
    if pp == 1:
        return [0.0]
    return [llm.engine.runner.link.wait_seconds, *llm.engine.executor.worker_waits()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["1:1", "1:2", "2:1", "2:2"],
                    help="PP 2 runs, each S:M (steps in flight : micro-batches a step)")
    args = ap.parse_args()
    path = build_model(Path(tempfile.mkdtemp()) / "llama-32m")
    prompts = workload(args.requests, 32, 512)
    configs = [(1, (1, 1))] + [(2, tuple(int(x) for x in v.split(":"))) for v in args.variants]
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for r in range(args.repeats):
        for pp, v in configs:
            runs[(pp, v)].append(run(path, prompts, args.new_tokens, pp, v))
        print(f"run {r + 1}: " + "; ".join(_describe(c, runs[c][-1]) for c in configs), flush=True)
    med = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in runs.items()}
    base = med[configs[0]]["tok_s"]
    print(f"\n| (median of {args.repeats}) | output tokens/s | against PP 1 | stage 0 idle | stage 1 idle |"
          "\n|---|---:|---:|---:|---:|")
    for (pp, (steps, m)), v in med.items():
        name = "PP 1, 2 threads" if pp == 1 else (f"PP 2, 1 thread a stage, {steps} step{'s' if steps > 1 else ''} "
                                                  f"in flight, {m} micro-batch{'es' if m > 1 else ''} a step")
        idle = f"{v['idle0']:.0%} | {v['idle1']:.0%}" if pp > 1 else " | "
        print(f"| {name} | {v['tok_s']:.1f} | {v['tok_s'] / base:.2f}x | {idle} |")
    print(f"\nweights: PP 1 {med[configs[0]]['weights'] / 2**20:.1f} MiB, PP 2 stage 0 "
          f"{med[configs[-1]]['weights'] / 2**20:.1f} MiB")


def _describe(config: tuple, result: dict) -> str:
    pp, (steps, m) = config
    if pp == 1:
        return f"PP1 {result['tok_s']:.1f} tok/s"
    return f"PP2 {steps}:{m} {result['tok_s']:.1f} tok/s (idle {result['idle0']:.0%} / {result['idle1']:.0%})"


if __name__ == "__main__":
    main()
