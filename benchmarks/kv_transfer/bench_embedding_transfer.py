"""One image's embeddings from an encoder process to a prefill process: NIXL READ from the
encoder's arena against the store's Redis, side by side in one run (E/P/D).

    .venv/bin/python -m benchmarks.kv_transfer.bench_embedding_transfer [--rows 64,256,1024] [--hidden 2048] [--runs 20]

The encoder side runs in a spawned process and publishes each image (arena write + digests, or
a Redis SET); the prefill side, this process, takes it (READ + digest check + copy out, or a
Redis GET + decode), as pdserve.node.encode and pdserve.node.embedding_intake do. Only msgspec
bytes cross the pipe. Medians over --runs images of each size; prints a markdown table.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection

import msgspec
import torch

from pdserve.kvstore.embedding_nixl import EmbeddingFetcher, EmbeddingPublisher
from pdserve.kvstore.embedding_store import EmbeddingStore
from pdserve.testing.redis_server import redis_server
from pdserve.wire.embedding_handover import EmbeddingHandover

DTYPE = torch.bfloat16


class Ask(msgspec.Struct):
    rows: int
    key: str


class Done(msgspec.Struct):
    seconds_nixl: float
    seconds_store: float
    handover: EmbeddingHandover


def _encoder(conn: Connection, hidden: int, max_rows: int, redis_url: str) -> None:
    publisher = EmbeddingPublisher("bench-encoder", 2 * max_rows, hidden, DTYPE, lease_s=60)
    store = EmbeddingStore(redis_url)
    conn.send_bytes(publisher.arena.agent.metadata())
    while True:
        try:
            ask = msgspec.msgpack.decode(conn.recv_bytes(), type=Ask)
        except EOFError:
            break
        rows = torch.randn(ask.rows, hidden).to(DTYPE)
        t0 = time.perf_counter()
        entry = publisher.publish(ask.key, rows, ask.key)
        t1 = time.perf_counter()
        store.put(store.key(b"bench", ask.key), rows)
        t2 = time.perf_counter()
        regions = publisher.arena.agent.block_regions(entry.block_ids)
        handover = EmbeddingHandover(ask.key, entry.rows, publisher.arena.agent.name, "", regions, entry.digests,
                                     ask.key, 60.0)
        conn.send_bytes(msgspec.msgpack.encode(Done(t1 - t0, t2 - t1, handover)))
        publisher.poll()
    store.close()
    publisher.close()


def measure(rows: int, runs: int, hidden: int, conn: Connection, fetcher: EmbeddingFetcher, peer: str,
            store: EmbeddingStore) -> dict[str, float]:
    times: dict[str, list[float]] = {"put_nixl": [], "take_nixl": [], "put_store": [], "take_store": []}
    nbytes = {}
    for i in range(runs):
        key = f"{rows}-{i}"
        conn.send_bytes(msgspec.msgpack.encode(Ask(rows, key)))
        done = msgspec.msgpack.decode(conn.recv_bytes(), type=Done)
        h = done.handover
        t0 = time.perf_counter()
        got = fetcher.fetch(peer, h.regions, h.digests, h.rows, h.lease_id.encode(), 5.0)
        t1 = time.perf_counter()
        loaded = store.get(store.key(b"bench", key))
        t2 = time.perf_counter()
        assert got is not None and loaded is not None and torch.equal(got.float(), loaded[0])
        times["put_nixl"].append(done.seconds_nixl)
        times["put_store"].append(done.seconds_store)
        times["take_nixl"].append(t1 - t0)
        times["take_store"].append(t2 - t1)
        nbytes = {"nixl": len(h.regions) * fetcher.arena.block_nbytes, "store": loaded[1]}
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return out | {f"bytes_{k}": v for k, v in nbytes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="64,256,1024", help="embedding rows (image tokens) per image")
    parser.add_argument("--hidden", type=int, default=2048, help="the language model's hidden size")
    parser.add_argument("--runs", type=int, default=20, help="images of each size")
    args = parser.parse_args()
    sizes = [int(r) for r in args.rows.split(",")]
    with redis_server() as (redis_url, _):
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_encoder, args=(child, args.hidden, max(sizes), redis_url), daemon=True)
        proc.start()
        fetcher = EmbeddingFetcher("bench-prefill", max(sizes), args.hidden, DTYPE)
        peer = fetcher.arena.agent.add_peer(conn.recv_bytes())
        fetcher.arena.agent.make_connection(peer)
        store = EmbeddingStore(redis_url)
        print(f"hidden {args.hidden}, {DTYPE} in the arena (float32 in Redis), medians of {args.runs} images\n")
        print("| rows | NIXL: publish / READ+check (ms) | bytes | store: SET / GET (ms) | bytes |")
        print("|---:|---:|---:|---:|---:|")
        for rows in sizes:
            r = measure(rows, args.runs, args.hidden, conn, fetcher, peer, store)
            print(f"| {rows} | {r['put_nixl']:.2f} / {r['take_nixl']:.2f} | {r['bytes_nixl']:,} "
                  f"| {r['put_store']:.2f} / {r['take_store']:.2f} | {r['bytes_store']:,} |")
        conn.close()
        proc.join(10)
        store.close()
        fetcher.close()


if __name__ == "__main__":
    main()
