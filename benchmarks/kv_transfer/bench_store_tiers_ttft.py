"""Warm / cold TTFT at a long shared prefix served from each tier of the default store alone.

    .venv/bin/python -m benchmarks.kv_transfer.bench_store_tiers_ttft [--prefix-len 2048] [--trials 3]
        [--model SmolLM2-135M-Instruct]  # any model pdserve serves, instead of the bench model
        [--tiers Redis]                  # only these rows
        [--flags "--handover push --prefetch-stored-prefix"]  # more `pdserve up` flags

1 prefill + 1 decode node over the default store (LMCache, 256-token chunks, its own Redis), the
~32M bench model served (support/bench_model.py) unless --model names another. Each trial: cold = prefix + question A (nothing cached
anywhere); then a filler prompt of the same length, which evicts the prefix from the prefill
node's paged cache (--num-kv-blocks holds one such prompt) so the warm request gets no local
hit; warm = prefix + question B (its `transfer` stage, the decode node's load after the first
token, is read from the router's /metrics). Where the warm prefix comes from is set by an LMCache config
file per row:
  CPU tier    max_local_cpu_size 1 GB: the prefill node's own CPU tier still holds the chunks
  disk tier   a 24 MiB CPU tier (the filler evicts the prefix from it) and a 1 GB disk tier
  Redis       a 24 MiB CPU tier, no disk: the chunks come back from Redis
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
from pathlib import Path

import httpx

from benchmarks.support.bench_model import build_served_model
from benchmarks.support.cluster import local_cluster, ttft_ms
from pdserve.loadgen.stages import scrape_stages, stage_breakdown

# Small enough that the filler evicts the prefix from it, big enough for two chunks of SmolLM2's
# float32 KV (11.8 MB each): LMCache stages every chunk in the CPU tier, and stores nothing without room.
SMALL_CPU_GB = 24 / 1024


def tier_configs(root: Path) -> dict[str, str]:
    rows = {"CPU tier": {"max_local_cpu_size": 1.0},
            "disk tier": {"max_local_cpu_size": SMALL_CPU_GB, "local_disk": f'"file://{root / "disk"}/"',
                          "max_local_disk_size": 1.0},
            "Redis": {"max_local_cpu_size": SMALL_CPU_GB}}
    paths = {}
    for name, values in rows.items():
        path = root / f"{name.split()[0].lower()}.yaml"
        lines = {"chunk_size": 256, "local_cpu": "true", "remote_serde": "naive", **values}
        path.write_text("".join(f"{k}: {v}\n" for k, v in lines.items()))
        paths[name] = str(path)
    (root / "disk").mkdir(exist_ok=True)
    return paths


def _stages(url: str) -> dict | None:
    async def scrape() -> dict | None:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            return await scrape_stages(client)
    return asyncio.run(scrape())


def run_tier(model: Path | str, config: str, args) -> list[tuple[float, float, float]]:
    blocks = (args.prefix_len + args.question_len) // 16 + 8  # one prompt's blocks, a little spare
    flags = ["--model", str(model), "--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "store",
             "--num-kv-blocks", str(blocks), "--lmcache-config", config, "--local-prefill-threshold", "0", *args.flags.split()]
    pairs = []
    with local_cluster(*flags) as c, httpx.Client() as client:
        model_id = client.get(f"{c.url}/v1/models", timeout=10).json()["data"][0]["id"]
        rng = random.Random(0)
        draw = lambda n: [rng.randrange(3, 258) for _ in range(n)]  # noqa: E731  (ids every tokenizer has)
        ttft_ms(client, c.url, model_id, draw(args.question_len) * 4)  # warm-up: connections, kernels
        for _ in range(args.trials):
            prefix = draw(args.prefix_len)
            cold = ttft_ms(client, c.url, model_id, prefix + draw(args.question_len))
            ttft_ms(client, c.url, model_id, draw(args.prefix_len + args.question_len))  # the filler
            before = _stages(c.url)
            warm = ttft_ms(client, c.url, model_id, prefix + draw(args.question_len))
            transfer = (stage_breakdown(before, _stages(c.url)) or {}).get("transfer", {}).get("mean_ms", 0.0)
            pairs.append((cold, warm, transfer))
            print(f"  cold {cold:.0f} ms, warm {warm:.0f} ms, warm transfer {transfer:.1f} ms", flush=True)
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--model", default=None,
                    help="a model pdserve serves (e.g. SmolLM2-135M-Instruct, the default GGUF); default: the ~32M bench model")
    ap.add_argument("--tiers", default="CPU tier,disk tier,Redis", help="comma-separated rows to run")
    ap.add_argument("--flags", default="", help="more `pdserve up` flags, e.g. \"--handover push\"")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    model = args.model or build_served_model(root / "llama-32m")
    wanted = args.tiers.split(",")
    rows = {}
    for name, config in tier_configs(root).items():
        if name not in wanted:
            continue
        print(f"{name}:", flush=True)
        pairs = run_tier(model, config, args)
        rows[name] = tuple(statistics.median(p[i] for p in pairs) for i in range(3))
    print(f"\n{Path(str(model)).name}, {args.prefix_len}-token shared prefix + {args.question_len}-token question, 1P1D over the "
          f"default store, no local hit, medians of {args.trials} trials\n")
    print("| warm prefix from | cold TTFT ms | warm TTFT ms | warm / cold | warm transfer ms |")
    print("|---|---:|---:|---:|---:|")
    for name, (cold, warm, transfer) in rows.items():
        print(f"| {name} | {cold:.0f} | {warm:.0f} | 1/{cold / warm:.1f} | {transfer:.1f} |")


if __name__ == "__main__":
    main()
