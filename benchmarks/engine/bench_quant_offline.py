"""SmolLM2-135M-Instruct's Q4_1 GGUF served offline by pdserve with its weights kept quantized,
against the same engine with the feature off (the GGUF dequantized to float32 at load, as
before). Runs alternate between the two engines so a change in the machine's load hits both;
medians of --repeats runs. Per concurrency (requests decoded together): output tokens/s and the
median decode step; plus the weights' bytes. Run:

    .venv/bin/python -m benchmarks.engine.bench_quant_offline --repeats 3
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from pdserve import LLM, SamplingParams
from pdserve.engine.footprint import weight_bytes
from pdserve.models import loader
from pdserve.models.gguf import DEFAULT_MODEL


def build(quantized: bool) -> LLM:
    keep = loader._quant_config
    if not quantized:  # the feature off: no quant config, every GGUF tensor dequantized
        loader._quant_config = lambda *a: None
    try:
        return LLM(DEFAULT_MODEL, num_kv_blocks=1024, enable_prefix_caching=False)
    finally:
        loader._quant_config = keep


def run(llm: LLM, concurrency: int, prompt_len: int, new_tokens: int, seed: int) -> float:
    """Output tokens/s of `concurrency` requests started together."""
    rng = random.Random(seed)
    vocab = llm.engine.model.spec.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(prompt_len)]}
               for _ in range(concurrency)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return concurrency * new_tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    engines = {"quantized": build(True), "float32": build(False)}
    for name, llm in engines.items():
        print(f"{name}: weights {weight_bytes(llm.engine.model) / 1e6:.1f} MB")
        run(llm, 2, 16, 4, seed=0)  # compile and warm up
    print(f"{'concurrency':>11} {'engine':>10} {'tokens/s (median)':>18} {'runs':>24}")
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        results: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(args.repeats):
            for name, llm in engines.items():
                results[name].append(run(llm, concurrency, args.prompt_len, args.new_tokens, seed=r))
        for name, values in results.items():
            runs = ", ".join(f"{v:.1f}" for v in values)
            print(f"{concurrency:>11} {name:>10} {statistics.median(values):>18.1f} {runs:>24}")


if __name__ == "__main__":
    main()
