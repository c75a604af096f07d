"""What chunk-granular reuse costs: store hit rate, LMCache chunks against direct Redis blocks.

    .venv/bin/python -m benchmarks.kv_transfer.bench_store_hit_rate [--chunk-tokens 64,256] [--prefix-lens 512,400,1000]

Replays pdserve.loadgen.bench's workloads (the same prompt generator and seeds) through real stores on a
real redis-server, the way a prefill node uses them: before each prompt, look up its full blocks
before the last token (lookup_prefix, the node's own call); after it, put every block, the partial
last one included. Each store starts empty; no node cache is involved, so the figure is what the
store alone gives a prefill node that does not hold the prefix itself (another node's prefix, or
one evicted from its paged cache). Hit rate = looked-up tokens found / prompt tokens.

The default store keeps whole chunks in LMCache and the tail block by block, so a reader misses
at most the part of a shared prefix that ends inside a chunk the writer's prompt filled with
different tokens. direct+redis:// is block-granular everywhere: the upper bound.
"""
from __future__ import annotations

import argparse
import random

import torch

from pdserve.kvstore.factory import make_store
from pdserve.kvstore.layout import KVLayout
from pdserve.loadgen.bench import BenchConfig, Prompt, build_sessions
from pdserve.protocol.block_keys import block_key_chain
from pdserve.testing.redis_server import redis_server

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32,
                  model_name="hit-rate")
SALT = b"bench-store-hit-rate"


def workload_prompts(workload: str, prefix_len: int, seed: int, output_len: int) -> list[list[int]]:
    """The prompts pdserve.loadgen.bench sends, in order; multi-round carries each answer (random ids
    of output_len here) into the next round's prompt, as the bench does with return_token_ids."""
    cfg = BenchConfig(workload=workload, num_groups=4, prompts_per_group=8, prefix_len=prefix_len,
                      question_len=32, num_users=8, num_rounds=4, seed=seed, max_token_id=30000)
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for session in build_sessions(cfg, rng):
        history: Prompt = []
        for question in session.questions:
            prompt = history + question if session.carry_history else question
            prompts.append(prompt)
            history = prompt + [rng.randrange(100, 30000) for _ in range(output_len)]
    return prompts


def replay(store_url: str, prompts: list[list[int]]) -> tuple[int, int]:
    """(tokens found in the store, prompt tokens) over the whole replay."""
    store = make_store(store_url, layout=LAYOUT)
    bs = LAYOUT.block_size
    longest = max(len(p) for p in prompts)
    cache = torch.randn(-(-longest // bs), *LAYOUT.block_shape())
    found = total = 0
    try:
        for prompt in prompts:
            keys = block_key_chain(prompt, bs, SALT, include_partial=True)
            found += store.lookup_prefix(keys[:(len(prompt) - 1) // bs]) * bs
            total += len(prompt)
            counts = [min(bs, len(prompt) - i * bs) for i in range(len(keys))]
            store.put(keys, cache, list(range(len(keys))), counts)
    finally:
        store.close()
    return found, total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunk-tokens", default="64,256")
    p.add_argument("--prefix-lens", default="512,400,1000",
                   help="shared-prefix lengths (bench_serving uses 512, pdserve bench 1024)")
    p.add_argument("--output-len", type=int, default=32, help="multi-round: answer tokens carried")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    chunks = [int(c) for c in args.chunk_tokens.split(",")]
    cases = [(f"shared-prefix, {n}-token prefix", "shared-prefix", int(n)) for n in args.prefix_lens.split(",")]
    cases.append((f"multi-round, {args.output_len}-token answers", "multi-round", 0))
    print("| workload | " + " | ".join([f"LMCache chunk {c}" for c in chunks] + ["direct Redis (per block)"]) + " |")
    print("|---|" + "---:|" * (len(chunks) + 1))
    for title, workload, prefix_len in cases:
        prompts = workload_prompts(workload, prefix_len or 1024, args.seed, args.output_len)
        cells = []
        for scheme, query in [("redis", f"?chunk_tokens={c}") for c in chunks] + [("direct+redis", "")]:
            # A fresh redis-server per store: a chunk-64 and a chunk-256 chunk can share a key.
            with redis_server() as (url, _):
                found, total = replay(url.replace("redis", scheme, 1) + query, prompts)
            cells.append(f"{100 * found / total:.1f}%")
        print(f"| {title} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
