"""Offline throughput on a Qwen3-MoE-shaped model (about 100M parameters, random weights):
pdserve beside transformers' continuous batching (generate_batch, paged|sdpa), in one run.

Shape: hidden 512, 7 layers, 8 heads of 64, 4 KV heads, 32 experts of intermediate 256, top 4,
vocab 8192 (Qwen3-30B-A3B's proportions, scaled down). Workload: 32 requests of 32-256 prompt
tokens, 32 new tokens each, ignore_eos, float32 on CPU.

    .venv/bin/python -m benchmarks.engine.bench_moe_offline --repeats 3
    NUMBA_NUM_THREADS=1 .venv/bin/python -m benchmarks.engine.bench_moe_offline --repeats 3 --threads 1
    .venv/bin/python -m benchmarks.engine.bench_moe_offline --split --repeats 3   # prefill / decode seconds
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.engine.offline_cpu_shares import cpu_shares
from benchmarks.engine.offline_model_bench import build_model, run_pdserve, workload

CONFIG = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_experts=32,
              num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=7, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64, vocab_size=8192, max_position_embeddings=2048,
              tie_word_embeddings=False, initializer_range=0.2)


def run_hf_continuous_batching(path: Path, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="paged|sdpa").eval()
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # Sized like pdserve's run; left to itself it takes 90% of the free memory for its cache.
    batching = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=2048, use_cuda_graph=False)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False,
                                   continuous_batching_config=batching)
    elapsed = time.perf_counter() - start
    tokens = [r.generated_tokens for r in sorted(out.values(), key=lambda r: int(r.request_id.split("_")[-1]))]
    return sum(len(t) for t in tokens) / elapsed, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads for both engines (0: torch's default, one per core)")
    ap.add_argument("--split", action="store_true",
                    help="instead: each engine's seconds for the prompts alone (1 new token) and for "
                         "the whole run, so the decode steps' share is the difference")
    ap.add_argument("--profile", action="store_true",
                    help="instead: pdserve's CPU seconds per part of the model (offline_cpu_shares.py)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:  # the checkpoint is 400 MB: not left behind
        run(args, Path(tmp) / "qwen3-moe-100m")


def run(args: argparse.Namespace, root: Path) -> None:
    path, params = build_model(root, "qwen3_moe", "Qwen3MoeForCausalLM", CONFIG)
    prompts = workload(args.requests, 32, 256, CONFIG["vocab_size"])
    if args.profile:
        shares = cpu_shares(path, prompts, args.new_tokens)
        total = shares[0][1]
        for label, seconds in shares:
            print(f"{label:58s} {seconds:6.2f} s CPU {100 * seconds / total:5.1f}%")
        return
    if args.split:
        print_split(path, prompts, args.new_tokens, args.repeats)
        return
    rows: dict[str, list[float]] = {"pdserve": [], "transformers generate_batch (paged|sdpa)": []}
    same = None
    for r in range(args.repeats):
        ours, our_tokens = run_pdserve(path, prompts, args.new_tokens)
        theirs, their_tokens = run_hf_continuous_batching(path, prompts, args.new_tokens)
        rows["pdserve"].append(ours)
        rows["transformers generate_batch (paged|sdpa)"].append(theirs)
        same = sum(a == b for a, b in zip(our_tokens, their_tokens))
        print(f"run {r + 1}: pdserve {ours:.1f} tok/s, transformers {theirs:.1f} tok/s, "
              f"same greedy tokens on {same}/{len(prompts)} requests", flush=True)
    base = statistics.median(rows["transformers generate_batch (paged|sdpa)"])
    print(f"\nmodel: {params / 1e6:.1f}M parameters; {args.requests} requests x {args.new_tokens} new tokens; "
          f"{torch.get_num_threads()} torch threads")
    print(f"| engine | output tokens/s (median of {args.repeats}) | vs generate_batch |")
    print("|---|---:|---:|")
    for name, values in rows.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.1f} | {med / base:.2f}x |")


def print_split(path: Path, prompts, new_tokens: int, repeats: int) -> None:
    """Median seconds of each engine over the prompts with 1 new token (prefill, plus one
    sampled token) and with new_tokens; the difference is the remaining decode steps."""
    runs = {"pdserve": run_pdserve, "transformers generate_batch": run_hf_continuous_batching}
    seconds: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):
        for name, run in runs.items():
            for n in (1, new_tokens):
                tokens_per_s, _ = run(path, prompts, n)
                seconds.setdefault((name, n), []).append(len(prompts) * n / tokens_per_s)
    print(f"| engine | prompts + 1 token, s | all {new_tokens} tokens, s | the other decode steps, s |")
    print("|---|---:|---:|---:|")
    for name in runs:
        first, whole = (statistics.median(seconds[name, n]) for n in (1, new_tokens))
        print(f"| {name} | {first:.2f} | {whole:.2f} | {whole - first:.2f} |")


if __name__ == "__main__":
    main()
