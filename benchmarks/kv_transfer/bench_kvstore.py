"""KV store throughput: the default store (LMCache over resp://) vs direct Redis vs memory.

    .venv/bin/python -m benchmarks.kv_transfer.bench_kvstore [--blocks 64] [--runs 7] [--chunk-tokens 64,256]
        [--redis-cluster]   # also a 3-master + 3-replica Redis Cluster (redis-cluster://) in the same run

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
import tempfile
import time
from collections.abc import Callable

import torch

from pdserve.kvstore.base import KVStore
from pdserve.kvstore.factory import make_store
from pdserve.kvstore.layout import KVLayout
from pdserve.testing.redis_cluster import redis_cluster
from pdserve.testing.redis_server import redis_server

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


def bench_store(writer: KVStore, reader: KVStore, blocks: int, runs: int,
                settle_s: float = 0.0) -> tuple[float, float]:
    """Median put (writer) and get (reader) seconds; asserts every get is complete and exact."""
    src = torch.randn(blocks, *LAYOUT.block_shape()[:2], *LAYOUT.block_shape()[2:])
    dst = torch.zeros_like(src)
    ids, counts = list(range(blocks)), [LAYOUT.block_size] * blocks
    puts, gets = [], []
    for run in range(runs + 1):
        keys = [os.urandom(16) for _ in range(blocks)]
        put_s = timed(lambda: writer.put(keys, src, ids, counts))
        time.sleep(settle_s)  # a disk tier writes in the background
        dst.zero_()
        get_s = timed(lambda: reader.get(keys, dst, ids[::-1], counts))
        assert torch.equal(dst.flip(0), src), "get returned different bytes"
        if run:  # run 0 warms connections and allocators
            puts.append(put_s)
            gets.append(get_s)
    return statistics.median(puts), statistics.median(gets)


def measure(url: str, blocks: int, runs: int, chunk_tokens: list[int]) -> list[Row]:
    rows: list[Row] = []
    for name, store_url in (("direct Redis (direct+redis://)", url.replace("redis://", "direct+redis://")),
                            ("memory:// (in-process LRU)", "memory://?max_gb=1")):
        store = make_store(store_url)
        try:
            rows.append((name, *bench_store(store, store, blocks, runs)))
        finally:
            store.close()
    return rows + measure_lmcache(url, blocks, runs, chunk_tokens)


def measure_lmcache(url: str, blocks: int, runs: int, chunk_tokens: list[int]) -> list[Row]:
    """Created after the direct runs so their engines' threads do not run beside them. The
    reader is a second store with its own (empty) CPU tier: its gets come from Redis."""
    tier_gb = max(0.1, 8 * blocks * LAYOUT.block_nbytes() / (1 << 30))
    rows: list[Row] = []
    for chunk in chunk_tokens:
        writer = make_store(url, layout=LAYOUT, local_cpu_gb=tier_gb, chunk_tokens=chunk)
        reader = make_store(url, layout=LAYOUT, local_cpu_gb=tier_gb, chunk_tokens=chunk)
        try:
            put_s, warm_s = bench_store(writer, writer, blocks, runs)
            rows.append((f"default redis:// (LMCache resp://), chunk {chunk}: get from its CPU tier", put_s, warm_s))
            put_s, cold_s = bench_store(writer, reader, blocks, runs)
            rows.append((f"default redis:// (LMCache resp://), chunk {chunk}: get from Redis", put_s, cold_s))
        finally:
            writer.close()
            reader.close()
    return rows


def measure_cluster(url: str, blocks: int, runs: int, chunk_tokens: list[int]) -> list[Row]:
    """The same store over a Redis Cluster: LMCache's cluster connector for whole chunks (a fresh
    reader: gets come from the cluster), and the direct client the partial-chunk tail uses."""
    from pdserve.kvstore.redis_store import RedisKVStore
    direct = RedisKVStore(url)
    try:
        rows: list[Row] = [("direct client on the cluster (the tail path)", *bench_store(direct, direct, blocks, runs))]
    finally:
        direct.close()
    tier_gb = max(0.1, 8 * blocks * LAYOUT.block_nbytes() / (1 << 30))
    for chunk in chunk_tokens:
        writer = make_store(url, layout=LAYOUT, local_cpu_gb=tier_gb, chunk_tokens=chunk)
        reader = make_store(url, layout=LAYOUT, local_cpu_gb=tier_gb, chunk_tokens=chunk)
        try:
            rows.append((f"redis-cluster:// (LMCache cluster connector), chunk {chunk}: get from the cluster",
                         *bench_store(writer, reader, blocks, runs)))
        finally:
            writer.close()
            reader.close()
    return rows


def measure_tiers(url: str, prefix_tokens: int, runs: int, disk_dir: str) -> list[Row]:
    """Load one prefix of prefix_tokens (256-token chunks) from each tier of the default store:
    its CPU tier, its disk tier (a CPU tier too small to hold it), and Redis (a fresh store)."""
    blocks = prefix_tokens // LAYOUT.block_size
    big = max(0.1, 4 * blocks * LAYOUT.block_nbytes() / (1 << 30))
    tiny = 2 * 16 * LAYOUT.block_nbytes() / (1 << 30)  # 2 chunks: the rest comes from disk
    configs = {"CPU tier": dict(local_cpu_gb=big),
               "disk tier": dict(local_cpu_gb=tiny, local_disk=disk_dir, local_disk_gb=big)}
    rows: list[Row] = []
    for tier, options in configs.items():
        store = make_store(url, layout=LAYOUT, **options)
        try:
            rows.append((f"{prefix_tokens}-token prefix from the {tier}", *bench_store(store, store, blocks, runs, settle_s=0.5 if "disk" in tier else 0)))
        finally:
            store.close()
    writer = make_store(url, layout=LAYOUT, local_cpu_gb=big)
    reader = make_store(url, layout=LAYOUT, local_cpu_gb=big)
    try:
        rows.append((f"{prefix_tokens}-token prefix from Redis (fresh store)", *bench_store(writer, reader, blocks, runs)))
    finally:
        writer.close()
        reader.close()
    return rows


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
    parser.add_argument("--prefix-tokens", type=int, default=2048,
                        help="prefix loaded from each tier of the default store (0: skip)")
    parser.add_argument("--chunk-tokens", default="64,256",
                        help="comma-separated LMCache chunk sizes to measure (multiples of 16)")
    parser.add_argument("--redis-cluster", action="store_true",
                        help="also measure a Redis Cluster of 3 masters and 3 replicas (started here)")
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunk_tokens.split(",")]
    torch.set_num_threads(1)
    nbytes = args.blocks * LAYOUT.block_nbytes()
    with redis_server() as (url, _proc):
        rows = measure(url, args.blocks, args.runs, chunks)
        if args.redis_cluster:
            with redis_cluster(masters=3, replicas=1) as cluster:
                rows += measure_cluster(cluster.url, args.blocks, args.runs, chunks)
        with tempfile.TemporaryDirectory() as disk:
            tiers = measure_tiers(url, args.prefix_tokens, args.runs, disk) if args.prefix_tokens else []
    print(f"{args.blocks} blocks x {LAYOUT.block_nbytes() // 1024} KiB = "
          f"{nbytes / (1 << 20):.0f} MiB per batch; median of {args.runs} runs\n")
    print(table(rows, nbytes, memcpy_seconds(nbytes, args.runs)))
    if tiers:
        tier_bytes = args.prefix_tokens // LAYOUT.block_size * LAYOUT.block_nbytes()
        print(f"\nOne {args.prefix_tokens}-token prefix ({tier_bytes / (1 << 20):.0f} MiB) through the default store's tiers\n")
        print(table(tiers, tier_bytes, memcpy_seconds(tier_bytes, args.runs)))


if __name__ == "__main__":
    main()
