"""The decode attention's work items, whole sequences against one per (sequence, KV head), in the
offline engine's decode steps on the default model: one process per batch size, the two settings
alternated every --steps-each steps over --rounds rounds (native_gemv.set_attend_sequence_items_from),
so that the machine's drift falls on both alike. Medians of the step times.

    .venv/bin/python -m benchmarks.engine.bench_attention_items [--batches 8,32,64,128] [--rounds 12]

Each batch: --prompt-len random token ids per request, prefilled, then the alternated decode steps."""
from __future__ import annotations

import argparse
import random
import statistics
import time

from pdserve import LLM, SamplingParams
from pdserve.kernels import native_gemv
from pdserve.models.gguf import DEFAULT_MODEL

SETTINGS = {"sequence items (default)": 0, "(sequence, KV head) items": 1 << 30}


def measure(model: str, batch: int, prompt_len: int, rounds: int, steps_each: int) -> dict[str, float]:
    llm = LLM(model, kv_cache_memory_gb=None)
    eng, rng = llm.engine, random.Random(batch)
    params = SamplingParams(max_tokens=len(SETTINGS) * rounds * steps_each + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"r{i}", [rng.randrange(100, 49000) for _ in range(prompt_len)], params)
    while eng.last_step_tokens != batch or eng.scheduler.step_prefill_tokens:
        eng.step()
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(rounds):
        for name, setting in SETTINGS.items():
            native_gemv.set_attend_sequence_items_from(setting)
            for _ in range(steps_each):
                start = time.perf_counter()
                eng.step()
                times[name].append(time.perf_counter() - start)
    native_gemv.set_attend_sequence_items_from(0)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batches", default="8,32,64,128")
    parser.add_argument("--prompt-len", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps-each", type=int, default=4)
    args = parser.parse_args()
    print("| requests | items | decode step ms (median) |\n|---:|---|---:|")
    for batch in (int(b) for b in args.batches.split(",")):
        for name, ms in measure(args.model, batch, args.prompt_len, args.rounds, args.steps_each).items():
            print(f"| {batch} | {name} | {ms:.1f} |", flush=True)


if __name__ == "__main__":
    main()
