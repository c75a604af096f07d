"""The compose demo (2 prefill + 2 decode containers, NIXL) against `pdserve up` with the same
2P2D over NIXL, on the same machine and workload (the aim: compose at >= 80% of it).

    DOCKER_HOST=... PDSERVE_BASE_IMAGE=... .venv/bin/python -m benchmarks.serving.bench_compose [--repeats 3]

Both stay up for the whole run; each is frozen while the other is measured (`docker-compose
pause`; SIGSTOP to `pdserve up`'s process group), and the two alternate across repeats so drift
on a shared machine favours neither. Each repeat uses a fresh seed: no prefix-cache carry-over.
Prints medians and the compose / `pdserve up` ratio.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import httpx

from benchmarks.support.cluster import free_port, local_cluster
from pdserve.loadgen.bench import BenchConfig, run_benchmark

ROOT = Path(__file__).resolve().parents[2]
UP_FLAGS = ("--prefill-nodes", "2", "--decode-nodes", "2", "--kv-transfer", "nixl")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    return p.parse_args()


def bench(args: argparse.Namespace, url: str, seed: int) -> dict:
    cfg = BenchConfig(base_url=url, workload="shared-prefix", num_groups=args.num_groups,
                      prompts_per_group=args.prompts_per_group, prefix_len=args.prefix_len,
                      question_len=args.question_len, output_len=args.output_len, min_token_id=100,
                      max_token_id=250, concurrency=args.concurrency, num_warmup=0, seed=seed,
                      temperature=0.0, disable_tqdm=True)
    report = asyncio.run(run_benchmark(cfg))
    assert report["failed"] == 0, report["errors"]
    return report


def wait_healthy(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            if r.status_code == 200 and all(n["healthy"] for n in r.json()["nodes"]):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy")


class Compose:
    def __init__(self) -> None:
        self.port = free_port()
        # The built-in model, as the `pdserve up` it is compared with (start_cluster's default).
        self.env = {**os.environ, "PDSERVE_PORT": str(self.port), "PDSERVE_MODEL": "builtin:tiny"}
        self.cli = ["docker-compose", "-p", f"pdsbench{os.getpid()}", "-f", str(ROOT / "compose.yaml")]
        self.url = f"http://127.0.0.1:{self.port}"

    def run(self, *args: str) -> None:
        subprocess.run([*self.cli, *args], check=True, cwd=ROOT, env=self.env, capture_output=True, timeout=1800)


def measure(name: str, url: str, args, seed: int, results: dict, pause, resume) -> None:
    resume()
    wait_healthy(url)
    r = bench(args, url, seed)
    pause()
    results.setdefault(name, []).append(r)
    print(f"{name:>12} seed {seed}: {r['request_throughput']:.2f} req/s, "
          f"TTFT p50 {r['p50_ttft_ms']:.0f} ms, e2e p99 {r['p99_e2e_ms']:.0f} ms", flush=True)


def main() -> None:
    args = parse_args()
    compose, results = Compose(), {}
    compose.run("up", "-d", "--build")
    try:
        wait_healthy(compose.url)
        bench(args, compose.url, 1)  # warm-up: numba caches, allocator
        compose.run("pause")
        with local_cluster(*UP_FLAGS) as up:
            group = os.getpgid(up.proc.pid)
            bench(args, up.url, 1)
            os.killpg(group, signal.SIGSTOP)
            for repeat in range(args.repeats):
                order = [("compose", compose.url, lambda: compose.run("pause"), lambda: compose.run("unpause")),
                         ("pdserve up", up.url, lambda: os.killpg(group, signal.SIGSTOP),
                          lambda: os.killpg(group, signal.SIGCONT))]
                for name, url, pause, resume in (order if repeat % 2 == 0 else order[::-1]):
                    measure(name, url, args, 1000 + repeat, results, pause, resume)
            os.killpg(group, signal.SIGCONT)
    finally:
        compose.run("down", "-v")
    print("\n| setup | req/s (median) | out tok/s | TTFT p50 ms | e2e p99 ms |\n|---|---:|---:|---:|---:|")
    med = {n: {k: statistics.median(r[k] for r in rs) for k in
               ("request_throughput", "output_throughput", "p50_ttft_ms", "p99_e2e_ms")} for n, rs in results.items()}
    for name, m in med.items():
        print(f"| {name} | {m['request_throughput']:.2f} | {m['output_throughput']:.1f} | "
              f"{m['p50_ttft_ms']:.0f} | {m['p99_e2e_ms']:.0f} |")
    ratio = med["compose"]["request_throughput"] / med["pdserve up"]["request_throughput"]
    print(f"\ncompose / pdserve up, requests/s: {ratio:.2f}")


if __name__ == "__main__":
    main()
