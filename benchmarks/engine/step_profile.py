"""The decode step and the prefill rate at 1, 8, 32 and 128 requests: float32, bf16 and int8 products
(--cpu-gemm-dtype; "auto": the engine's defaults, not run unless --settings names it), bf16 and int8 over a bf16 KV cache (--kv-cache-dtype), on the default model
in one process per setting, the batch sizes interleaved over --repeats rounds (medians); int8
where the CPU has AVX-512 VNNI, bf16 where it has AVX-512 BF16 or AMX.

    .venv/bin/python -m benchmarks.engine.step_profile [--model M] [--repeats 3] [--batches 1,8,32,128] [--settings auto ...]

Each cell: --prompt-len random token ids per request, prefilled (tokens/s over the prefill steps),
then --steps decode steps of all requests (median step time, and requests / step time)."""
from __future__ import annotations

import argparse
import random
import statistics
import time

from pdserve import LLM, SamplingParams
from pdserve.kernels.dequant_tiles import resolve_gemm_dtype
from pdserve.models.gguf import DEFAULT_MODEL

SETTINGS = {"auto": {}, "float32": {"cpu_gemm_dtype": "float32"}, "bfloat16": {"cpu_gemm_dtype": "bfloat16"},
            "bfloat16 + bf16 KV": {"cpu_gemm_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"},
            "int8": {"cpu_gemm_dtype": "int8"},
            "int8 + bf16 KV": {"cpu_gemm_dtype": "int8", "kv_cache_dtype": "bfloat16"}}


def measure(llm: LLM, batch: int, prompt_len: int, steps: int, seed: int) -> tuple[float, float]:
    eng, rng = llm.engine, random.Random(seed)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    rids = [f"s{seed}-{i}" for i in range(batch)]
    for rid in rids:
        eng.add_request(rid, [rng.randrange(100, 49000) for _ in range(prompt_len)], params)
    t0, tokens = time.perf_counter(), 0
    while eng.last_step_tokens != batch or eng.scheduler.step_prefill_tokens:
        eng.step()
        tokens += eng.last_step_tokens
    prefill = tokens / (time.perf_counter() - t0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    for rid in rids:
        eng.abort_request(rid)
    eng.step()
    return prefill, statistics.median(times)


def runs_here(flags: dict) -> bool:
    """Whether this CPU takes the setting's products (bf16: AVX-512 BF16 or AMX; int8: VNNI)."""
    try:
        resolve_gemm_dtype(flags.get("cpu_gemm_dtype", "auto"))
    except ValueError:
        return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", default="1,8,32,128", type=lambda s: [int(b) for b in s.split(",")])
    p.add_argument("--prompt-len", type=int, default=160)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=[s for s in SETTINGS if s != "auto"])
    args = p.parse_args()
    cells: dict[tuple[str, int], list[tuple[float, float]]] = {}
    settings = {name: SETTINGS[name] for name in args.settings if runs_here(SETTINGS[name])}
    for dtype, flags in settings.items():
        llm = LLM(args.model, max_num_seqs=max(args.batches), kv_cache_memory_gb=4, **flags)
        for r in range(args.repeats):
            for batch in args.batches:
                cells.setdefault((dtype, batch), []).append(measure(llm, batch, args.prompt_len, args.steps, r))
        del llm
    print("| requests | products | prefill tok/s | decode step ms | decode tok/s |\n|---:|---|---:|---:|---:|")
    for batch in args.batches:
        for dtype in settings:
            runs = cells[(dtype, batch)]
            prefill = statistics.median(r[0] for r in runs)
            step = statistics.median(r[1] for r in runs)
            print(f"| {batch} | {dtype} | {prefill:.0f} | {step * 1e3:.1f} | {batch / step:.0f} |")


if __name__ == "__main__":
    main()
