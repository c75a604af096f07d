"""Offline throughput with batched multi-LoRA: one batch mixing 4 adapters (rank 16, on q/k/v/o
and gate/up/down) against the base model alone, in one run.

Model: the ~32M-parameter Llama of support/bench_model.py (hidden 512, 8 layers, 8 heads, 4 KV heads,
vocab 8192), random weights, float32 on CPU. Adapters: PEFT's, random A and B. Workload: 32
requests of 32-256 prompt tokens, 32 new tokens each, ignore_eos. Rows, each the median of
--repeats timed generates (after a warm-up):

- base: an engine without LoRA, every request on the base model;
- lora engine, base requests: LoRA on (4 slots), every request on the base model;
- 4 adapters mixed: the same engine, request i on adapter i % 4;
- 4 adapters, max_loras 2: an engine with 2 slots, so adapters swap in and out (LRU).

    .venv/bin/python -m benchmarks.engine.bench_lora --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.support.bench_model import build_model, workload

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, root: Path, count: int, rank: int) -> dict[str, str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    paths = {}
    for i in range(count):
        torch.manual_seed(100 + i)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)),
                               LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES, init_lora_weights=False))
        path = root / f"adapter{i}"
        model.save_pretrained(path)
        paths[f"adapter{i}"] = str(path)
    return paths


def timed(llm, prompts, params, lora_requests) -> tuple[float, float]:
    """Output tokens per second of one generate over every prompt: per wall-clock second, and
    per CPU second of this process (which other work on a shared machine disturbs less)."""
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=lora_requests)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / elapsed, tokens / cpu


def main() -> None:
    from pdserve import LLM, LoRARequest, SamplingParams
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    base = build_model(root / "base")
    adapters = make_adapters(base, root, 4, args.rank)
    requests = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())]
    prompts = workload(args.requests, 32, 256)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    engine = dict(num_kv_blocks=1024, max_num_batched_tokens=2048, enable_prefix_caching=False)
    plain = LLM(str(base), **engine)
    lora = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=args.rank, **engine)
    swapping = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=args.rank, **engine)
    mixed = [requests[i % 4] for i in range(len(prompts))]
    rows = {"base (no LoRA)": (plain, None), "lora engine, base requests": (lora, None),
            "4 adapters mixed (max_loras 4)": (lora, mixed), "4 adapters, max_loras 2 (swapping)": (swapping, mixed)}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in rows}
    for llm, reqs in rows.values():  # warm-up: the first generate pays one-time costs
        llm.generate([{"prompt_token_ids": prompts[0][:32]}], params, use_tqdm=False,
                     lora_request=reqs[0] if reqs else None)
    for _ in range(args.repeats):  # interleaved, so drifting load on the machine hits every row
        for name, (llm, reqs) in rows.items():
            results[name].append(timed(llm, prompts, params, reqs))
    base_wall, base_cpu = (statistics.median(v[i] for v in results["base (no LoRA)"]) for i in (0, 1))
    print(f"{args.requests} requests, 32-256 prompt tokens, {args.new_tokens} new tokens, rank {args.rank}, "
          f"torch threads {torch.get_num_threads()}, {args.repeats} repeats")
    print("| run | output tok/s (median) | vs base | tok per CPU-s (median) | vs base | wall tok/s, all runs |")
    print("|---|---|---|---|---|---|")
    for name, values in results.items():
        wall, cpu = (statistics.median(v[i] for v in values) for i in (0, 1))
        print(f"| {name} | {wall:.1f} | {wall / base_wall:.2f}x | {cpu:.1f} | {cpu / base_cpu:.2f}x | "
              f"{', '.join(f'{v[0]:.1f}' for v in values)} |")
    print(f"slot loads: max_loras 4: {lora.engine.lora.slot_loads}, max_loras 2: {swapping.engine.lora.slot_loads}")


if __name__ == "__main__":
    main()
