"""Cold against warm TTFT at a long shared prefix, on 2 prefill + 2 decode nodes with Redis.

    .venv/bin/python benchmarks/bench_prefix_ttft.py [--prefix-len 2048] [--trials 5]

The ~32M bench model (benchmarks/bench_offline.py's shape, with the byte tokenizer). Each trial
draws a fresh prefix; the cold request is prefix + question A (nothing cached anywhere), the warm
one is prefix + question B right after it. TTFT is the time to the first streamed token, seen by
the client. Configs run side by side on the same machine:
  disaggregated   every prompt goes through a prefill node (which finds the prefix in its cache
                  or in Redis) and is handed over to a decode node
  local tail      --local-prefill-threshold 128: the decode node that holds the prefix computes
                  the 64-token question itself, with no handover
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_offline import CONFIG  # noqa: E402
from cluster import local_cluster  # noqa: E402

CONFIGS = {"disaggregated": ["--local-prefill-threshold", "0"], "local tail": ["--local-prefill-threshold", "128"]}


def build_model(root: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pdserve.models.builtin import build_byte_tokenizer
    torch.manual_seed(0)
    config = LlamaConfig(**{**CONFIG, "max_position_embeddings": 4096}, architectures=["LlamaForCausalLM"])
    AutoModelForCausalLM.from_config(config).save_pretrained(root)
    build_byte_tokenizer().save_pretrained(root)
    return root


def ttft_ms(url: str, model: str, prompt: list[int]) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return (time.perf_counter() - t0) * 1e3
    raise RuntimeError("no token streamed")


def run_config(model: Path, flags: list[str], args) -> list[tuple[float, float]]:
    cluster_flags = ["--model", str(model), "--prefill-nodes", "2", "--decode-nodes", "2",
                     "--kv-transfer", "store", "--num-kv-blocks", "2048", *flags]
    pairs = []
    with local_cluster(*cluster_flags) as c:
        model_id = httpx.get(f"{c.url}/v1/models", timeout=10).json()["data"][0]["id"]
        rng = random.Random(0)
        question = lambda: [rng.randrange(3, 258) for _ in range(args.question_len)]  # noqa: E731
        ttft_ms(c.url, model_id, question() * 4)  # warm-up: connections, kernels
        for _ in range(args.trials):
            prefix = [rng.randrange(3, 258) for _ in range(args.prefix_len)]
            cold = ttft_ms(c.url, model_id, prefix + question())
            warm = ttft_ms(c.url, model_id, prefix + question())
            pairs.append((cold, warm))
            print(f"  cold {cold:.0f} ms, warm {warm:.0f} ms", flush=True)
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    model = build_model(Path(tempfile.mkdtemp()) / "llama-32m")
    rows = {}
    for name, flags in CONFIGS.items():
        print(f"{name}:", flush=True)
        pairs = run_config(model, flags, args)
        cold = statistics.median(p[0] for p in pairs)
        warm = statistics.median(p[1] for p in pairs)
        rows[name] = {"cold_ms": cold, "warm_ms": warm, "warm_over_cold": warm / cold, "pairs": pairs}
    print(f"\n{args.prefix_len}-token shared prefix + {args.question_len}-token question, 2P2D with Redis, "
          f"medians of {args.trials} trials\n")
    print("| config | cold TTFT ms | warm TTFT ms | warm / cold |")
    print("|---|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['cold_ms']:.0f} | {r['warm_ms']:.1f} | 1/{1 / r['warm_over_cold']:.1f} |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
