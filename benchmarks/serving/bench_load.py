"""Load: many concurrent streaming clients (the official openai client, no retries) against
`pdserve up` 2P2D on the built-in model. Reports completed and failed requests, dropped
connections, TTFT and end-to-end p50/p99, each process's RSS in the first and the last quarter
of the run, and the KV blocks in use once traffic drains (must be 0).

    .venv/bin/python -m benchmarks.serving.bench_load --clients 256 --requests 2048
    .venv/bin/python -m benchmarks.serving.bench_load --clients 256 --requests 10000   # RSS flatness
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import threading
import time

import openai
import psutil

from pdserve.testing.up_cluster import node_pids, node_stats, running_cluster


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else 0.0


async def client_loop(client, queue: asyncio.Queue, results: list, errors: list) -> None:
    while True:
        try:
            prompt, max_tokens = queue.get_nowait()
        except asyncio.QueueEmpty:
            return
        t0 = time.perf_counter()
        ttft = None
        try:
            stream = await client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=max_tokens,
                                                     stream=True, temperature=0, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and ttft is None:
                    ttft = time.perf_counter() - t0
            results.append((ttft, time.perf_counter() - t0))
        except Exception as exc:  # counted, not retried: the point is that none happen
            errors.append(f"{type(exc).__name__}: {exc}")


def sample_rss(pids: dict[str, int], done: list, total: int, stop: threading.Event, rss: dict) -> None:
    """RSS per process, tagged with the share of requests completed when sampled."""
    procs = {name: psutil.Process(pid) for name, pid in pids.items()}
    while not stop.is_set():
        progress = len(done) / total
        for name, proc in procs.items():
            try:
                rss.setdefault(name, []).append((progress, proc.memory_info().rss))
            except psutil.Error:
                pass
        stop.wait(1.0)


async def drive(url: str, clients: int, requests: int, results: list, errors: list) -> None:
    rng = random.Random(0)
    queue: asyncio.Queue = asyncio.Queue()
    for _ in range(requests):
        queue.put_nowait(([rng.randrange(20, 250) for _ in range(rng.randrange(16, 128))], rng.randrange(8, 32)))
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600,
                                http_client=None)
    await asyncio.gather(*(client_loop(client, queue, results, errors) for _ in range(clients)))
    await client.close()


def rss_growth(rss: dict) -> dict[str, tuple[float, float]]:
    """name -> (mean RSS MB in the first quarter, in the last quarter)."""
    out = {}
    for name, samples in rss.items():
        first = [r for p, r in samples if p <= 0.25]
        last = [r for p, r in samples if p >= 0.75]
        if first and last:
            out[name] = (statistics.mean(first) / 2**20, statistics.mean(last) / 2**20)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--requests", type=int, default=2048)
    args = ap.parse_args()
    with running_cluster("--prefill-nodes", "2", "--decode-nodes", "2", "--local-prefill-threshold", "0",
                         timeout_s=300) as (url, proc):
        results, errors, rss, stop = [], [], {}, threading.Event()
        sampler = threading.Thread(target=sample_rss, args=(node_pids(proc.pid), results, args.requests, stop, rss))
        sampler.start()
        t0 = time.perf_counter()
        asyncio.run(drive(url, args.clients, args.requests, results, errors))
        wall = time.perf_counter() - t0
        stop.set()
        sampler.join()
        time.sleep(1.0)  # the last pongs
        in_use = {n: s.get("kv_blocks_in_use") for n, s in node_stats(url).items()}
    ttft = [t for t, _ in results if t is not None]
    e2e = [e for _, e in results]
    print(f"{args.clients} clients, {args.requests} requests in {wall:.1f} s: {len(results)} completed, "
          f"{len(errors)} failed ({sorted(set(errors))[:3]})")
    print(f"TTFT p50 {1e3 * percentile(ttft, 50):.0f} ms, p99 {1e3 * percentile(ttft, 99):.0f} ms; "
          f"end-to-end p50 {1e3 * percentile(e2e, 50):.0f} ms, p99 {1e3 * percentile(e2e, 99):.0f} ms")
    print(f"KV blocks in use after the run: {in_use}")
    for name, (first, last) in sorted(rss_growth(rss).items()):
        print(f"RSS {name}: first quarter {first:.0f} MB, last quarter {last:.0f} MB ({100 * (last / first - 1):+.1f}%)")


if __name__ == "__main__":
    main()
