"""Where a GPU decode step's time goes: the engine's step split into its phases, eager against
CUDA graphs, plus a torch.profiler table of one step's kernels in each mode.

    python3 -m benchmarks.gpu.gpu_decode_profile --out DIR [--requests 256 --prompt-len 512 --steps 30]

The 1.1B Llama of gpu_throughput.py (bf16). Every request is prefilled first; then --steps pure
decode steps of all --requests sequences are timed phase by phase (schedule; model forward with
its inputs, synchronised; KV bookkeeping; sampling; output processing), mirroring
LLMEngine.step. Medians per phase are written to DIR/decode_profile.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.gpu.gpu_throughput import build_model, workload


def make_engine(model: str, requests: int, prompt_len: int, new_tokens: int, eager: bool):
    from pdserve.assembly.build import build_engine
    from pdserve.engine.config import EngineConfig
    blocks = requests * (-(-(prompt_len + new_tokens) // 16)) + 64
    return build_engine(EngineConfig(model=model, dtype="bfloat16", device="cuda", num_kv_blocks=blocks,
                                  max_num_seqs=requests, max_num_batched_tokens=8192,
                                  kernel_backend="triton", enforce_eager=eager))


def fill(engine, requests: int, prompt_len: int, new_tokens: int) -> None:
    from pdserve.protocol.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(workload(requests, prompt_len)):
        engine.add_request(str(i), p, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()


def timed_step(engine) -> dict:
    """LLMEngine.step, phase by phase (keep in step with engine.py)."""
    from pdserve.engine.sampler import sample
    sync = torch.cuda.synchronize
    t = [time.perf_counter()]
    batch = engine.scheduler.schedule()
    t.append(time.perf_counter())
    logits, to_sample = engine.runner.execute(batch.items)
    t.append(time.perf_counter())
    sync()
    t.append(time.perf_counter())
    for req, n in batch.items:
        req.num_computed_tokens += n
        engine.kv.commit(req)
    t.append(time.perf_counter())
    params = [r.sampling_params for r in to_sample]
    tokens, logprobs = sample(logits, params, [r.num_output_tokens for r in to_sample])
    t.append(time.perf_counter())
    for req, tok, lp in zip(to_sample, tokens, logprobs):
        engine.advance(req, tok, lp)
    t.append(time.perf_counter())
    names = ["schedule", "execute_launch", "execute_gpu_wait", "kv_commit", "sample", "advance"]
    out = {k: (b - a) * 1e3 for k, a, b in zip(names, t, t[1:])}
    out["total"] = (t[-1] - t[0]) * 1e3
    out["batch"] = len(batch.items)
    return out


def forward_only_ms(engine, runs: int = 20) -> float:
    """The runner's execute alone, CUDA-event timed, on the same batch (no state advanced)."""
    items = [(r, 1) for r in engine.scheduler.running]
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        engine.runner.execute(items)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_fill_ms(engine, runs: int = 20) -> float:
    """Host time to build one decode step's inputs for every running request (numpy)."""
    from pdserve.engine.step_inputs import build_step_inputs
    items = [(r, 1) for r in engine.scheduler.running]
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        build_step_inputs(items, len(items), engine.config.block_size)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def profile_table(engine) -> dict:
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    return {"kernel_launches": sum(e.count for e in kernels), "gpu_busy_ms": gpu_us / 1e3,
            "table": events.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60)}


def run_mode(args, eager: bool) -> dict:
    engine = make_engine(args.model, args.requests, args.prompt_len, args.new_tokens, eager)
    fill(engine, args.requests, args.prompt_len, args.new_tokens)
    steps = [timed_step(engine) for _ in range(args.steps)]
    steps = [s for s in steps if s["batch"] == args.requests]
    result = {k: statistics.median(s[k] for s in steps) for k in steps[0] if k != "batch"}
    result["steps"] = len(steps)
    result["forward_only_ms"] = forward_only_ms(engine)
    result["context_tokens"] = sum(r.num_tokens for r in engine.scheduler.running)
    result["host_fill_ms"] = host_fill_ms(engine)
    result["profile"] = profile_table(engine)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--modes", default="eager,graphs")
    args = ap.parse_args()
    args.model = args.model or str(build_model(Path("/tmp/pdserve-llama-1b")))
    result = {}
    for mode in args.modes.split(","):
        result[mode] = run_mode(args, eager=mode == "eager")
        profile = result[mode].get("profile", {})
        print(f"== {mode}", json.dumps({k: v for k, v in result[mode].items() if k != "profile"}),
              flush=True)
        if profile:
            print(profile["table"], f"launches {profile['kernel_launches']}, GPU busy "
                  f"{profile['gpu_busy_ms']:.2f} ms", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "decode_profile.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
