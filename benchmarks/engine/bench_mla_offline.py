"""Offline throughput on a DeepSeek-V3-shaped model (about 100M parameters, random weights):
pdserve beside transformers in one run.

Shape (DeepSeek-V3's proportions, scaled down): hidden 512, 7 layers (the first dense), 8 heads,
q LoRA 192, KV LoRA 128 + 32 rotary (a 160-value latent per token and layer), qk_nope 64,
v 64, 32 routed experts of intermediate 256 in 4 groups (top 2 groups, top 4 experts) plus one
shared expert, vocab 8192. Workload: 32 requests of 32-256 prompt tokens, 32 new tokens each,
ignore_eos, float32 on CPU.

transformers runs it with one left-padded `generate` call over all requests, sdpa attention and
its experts in the eager loop: its continuous batching (`generate_batch`) does not run MLA models
(the paged cache holds K/V per head).

    .venv/bin/python -m benchmarks.engine.bench_mla_offline --repeats 3
    NUMBA_NUM_THREADS=1 .venv/bin/python -m benchmarks.engine.bench_mla_offline --repeats 3 --threads 1
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.engine.offline_model_bench import build_model, run_pdserve, workload

CONFIG = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=32,
              num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
              num_hidden_layers=7, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=192,
              kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, vocab_size=8192,
              max_position_embeddings=2048, tie_word_embeddings=False, initializer_range=0.2)


def run_transformers(path: Path, prompts, new_tokens: int) -> tuple[str, float, list[list[int]]]:
    """One left-padded generate over all prompts. (generate_batch does not run MLA models: its
    paged cache holds K/V per head, and every request fails inside it with an index_copy_ shape
    error; the cache it allocates also stays in memory.)"""
    from transformers import AutoModelForCausalLM
    # Experts in transformers' own loop over experts (as pdserve: one matmul per expert).
    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa",
                                                 experts_implementation="eager").eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    elapsed = time.perf_counter() - start
    return "generate (one padded batch)", len(prompts) * new_tokens / elapsed, out[:, width:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads for both engines (0: torch's default, one per core)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = workload(args.requests, 32, 256, CONFIG["vocab_size"])
    with tempfile.TemporaryDirectory() as tmp:
        path, params = build_model(Path(tmp), "deepseek_v3", "DeepseekV3ForCausalLM", CONFIG)
        print(f"DeepSeek-V3-shaped model: {params / 1e6:.1f}M parameters; {len(prompts)} requests, "
              f"{sum(map(len, prompts))} prompt tokens, {args.new_tokens} new tokens each")
        ours, theirs, agree, how = [], [], [], ""
        for _ in range(args.repeats):
            tps, our_tokens = run_pdserve(path, prompts, args.new_tokens)
            ours.append(tps)
            how, tps, their_tokens = run_transformers(path, prompts, args.new_tokens)
            theirs.append(tps)
            agree.append(sum(a == b for a, b in zip(our_tokens, their_tokens)))
            print(f"run {len(ours)}: pdserve {ours[-1]:.1f} tok/s, transformers {tps:.1f} tok/s, "
                  f"same greedy tokens on {agree[-1]}/{len(prompts)} requests", flush=True)
    a, b = statistics.median(ours), statistics.median(theirs)
    print("| engine | output tokens/s (median) | runs |")
    print("| --- | ---: | --- |")
    print(f"| pdserve | {a:.1f} | {', '.join(f'{x:.1f}' for x in ours)} |")
    print(f"| transformers {how} | {b:.1f} | {', '.join(f'{x:.1f}' for x in theirs)} |")
    print(f"pdserve / transformers: {a / b:.2f}x; identical greedy outputs: {min(agree)}/{len(prompts)}")


if __name__ == "__main__":
    main()
