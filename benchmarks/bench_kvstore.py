"""KV store throughput: direct Redis vs LMCache (CPU tier + Redis) vs in-process memory.

    .venv/bin/python benchmarks/bench_kvstore.py [--blocks 64] [--runs 5]

Every path moves the same blocks (default: 64 blocks of 8 layers x 4 KV heads x head_dim 64 x
16 tokens, fp32 = 256 KiB each, 16 MiB in all) between a paged cache and the store, with fresh
keys each run so nothing is deduplicated. Reports the median of --runs timed runs (after one
warm-up) in GB/s (1e9 bytes/s), beside a single-thread torch memcpy of the same bytes. Starts its
own redis-server. Torch runs single-threaded throughout, so copies are comparable.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from redis_util import redis_server  # noqa: E402

from pdserve.kvstore.base import KVStore  # noqa: E402
from pdserve.kvstore.factory import make_store  # noqa: E402
from pdserve.kvstore.layout import KVLayout  # noqa: E402

LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, block_size=16,
                  dtype=torch.float32, model_name="bench")
Row = tuple[str, float, float]  # name, put seconds, get seconds


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def memcpy_seconds(nbytes: int, runs: int) -> float:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    return statistics.median(timed(lambda: dst.copy_(src)) for _ in range(runs))


def bench_store(writer: KVStore, reader: KVStore, blocks: int, runs: int) -> tuple[float, float]:
    """Median put (writer) and get (reader) seconds; asserts every get is complete and exact."""
    src = torch.randn(blocks, *LAYOUT.block_shape()[:2], *LAYOUT.block_shape()[2:])
    dst = torch.zeros_like(src)
    ids, counts = list(range(blocks)), [LAYOUT.block_size] * blocks
    puts, gets = [], []
    for run in range(runs + 1):
        keys = [os.urandom(16) for _ in range(blocks)]
        put_s = timed(lambda: writer.put(keys, src, ids, counts))
        dst.zero_()
        get_s = timed(lambda: reader.get(keys, dst, ids[::-1], counts))
        assert torch.equal(dst.flip(0), src), "get returned different bytes"
        if run:  # run 0 warms connections and allocators
            puts.append(put_s)
            gets.append(get_s)
    return statistics.median(puts), statistics.median(gets)


def measure(url: str, blocks: int, runs: int) -> list[Row]:
    rows: list[Row] = []
    for name, store_url in (("direct Redis (redis://)", url),
                            ("memory:// (in-process LRU)", "memory://?max_gb=1")):
        store = make_store(store_url)
        try:
            rows.append((name, *bench_store(store, store, blocks, runs)))
        finally:
            store.close()
    return rows + measure_lmcache(url, blocks, runs)


def measure_lmcache(url: str, blocks: int, runs: int) -> list[Row]:
    """Created after the direct runs so their engines' threads do not run beside them."""
    lm_url = url.replace("redis://", "lmcache+redis://")
    tier_gb = max(0.1, 8 * blocks * LAYOUT.block_nbytes() / (1 << 30))
    writer = make_store(lm_url, layout=LAYOUT, local_cpu_gb=tier_gb)
    reader = make_store(lm_url, layout=LAYOUT, local_cpu_gb=tier_gb)
    try:
        put_s, warm_s = bench_store(writer, writer, blocks, runs)
        rows = [("LMCache+Redis, get from its CPU tier", put_s, warm_s)]
        put_s, cold_s = bench_store(writer, reader, blocks, runs)
        rows.append(("LMCache+Redis, get from Redis (cold CPU tier)", put_s, cold_s))
        return rows
    finally:
        writer.close()
        reader.close()


def table(rows: list[Row], nbytes: int, memcpy_s: float) -> str:
    gbs = lambda s: nbytes / s / 1e9  # noqa: E731
    lines = ["| path | put GB/s | get GB/s | put ms | get ms |", "|---|---:|---:|---:|---:|"]
    for name, put_s, get_s in rows:
        lines.append(f"| {name} | {gbs(put_s):.2f} | {gbs(get_s):.2f} | "
                     f"{put_s * 1e3:.1f} | {get_s * 1e3:.1f} |")
    lines.append(f"| torch memcpy, 1 thread (same bytes) | {gbs(memcpy_s):.2f} | "
                 f"{gbs(memcpy_s):.2f} | {memcpy_s * 1e3:.1f} | {memcpy_s * 1e3:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    nbytes = args.blocks * LAYOUT.block_nbytes()
    with redis_server() as (url, _proc):
        rows = measure(url, args.blocks, args.runs)
    print(f"{args.blocks} blocks x {LAYOUT.block_nbytes() // 1024} KiB = "
          f"{nbytes / (1 << 20):.0f} MiB per batch; median of {args.runs} runs\n")
    print(table(rows, nbytes, memcpy_seconds(nbytes, args.runs)))


if __name__ == "__main__":
    main()
