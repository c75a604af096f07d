"""TTFT of one prompt at a time, by prompt length, vLLM CPU beside pdserve (no other load: what a
long prompt costs alone, its chunks and its attention included).

    .venv/bin/python -m benchmarks.peers.bench_prompt_ttft --lengths 160,700,1500,2400 --repeats 5

Servers (every core each, up together, measured in turn while the others are stopped): `vllm` on the
bf16 directory (bench_vs_vllm's), `pdserve` monolithic on the default GGUF
(`pdserve up --prefill-nodes 0 --decode-nodes 1 --threads-per-node N`), `pdserve@base` the same
from another checkout (--baseline-src DIR). Each request: random token ids (new ones every time, so
nothing is cached), 8 tokens streamed with ignore_eos; TTFT is the first streamed chunk's arrival.
Reported: the median of --repeats per length, after one untimed request per length.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.peers.bench_vs_llamacpp import paused, process_tree
from benchmarks.peers.bench_vs_vllm import DEFAULT_VLLM_PYTHON, bf16_checkpoint, vllm_server
from benchmarks.support.cluster import local_cluster, source_info
from pdserve.models.gguf import DEFAULT_MODEL

CORES = os.cpu_count() or 2
MONOLITHIC = ("--model", DEFAULT_MODEL, "--prefill-nodes", "0", "--decode-nodes", "1", "--threads-per-node", str(CORES))


def first_chunk_s(url: str, model: str, prompt: list[int]) -> float:
    body = dict(model=model, prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True, stream=True)
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:"):
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without a chunk")


def measure(url: str, lengths: list[int], repeats: int, rng: random.Random) -> dict[int, list[float]]:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]

    def ttft_ms(n: int) -> float:
        return first_chunk_s(url, model, [rng.randrange(100, 30000) for _ in range(n)]) * 1e3

    for n in lengths:
        ttft_ms(n)  # untimed: the first of each shape
    return {n: [ttft_ms(n) for _ in range(repeats)] for n in lengths}


def start_servers(stack: contextlib.ExitStack, args, log_dir: Path) -> dict[str, dict]:
    up = {}
    if "vllm" in args.servers:
        args.threads, args.max_num_seqs = CORES, 128  # what bench_vs_vllm's vllm_server reads
        url, pid, _ = stack.enter_context(vllm_server(args, bf16_checkpoint(Path(args.bf16_dir)), log_dir / "vllm.log"))
        up["vllm"] = {"url": url, "pid": pid}
    for name in ("pdserve", "pdserve@base"):
        if name in args.servers:
            source = args.baseline_src if name.endswith("@base") else None
            c = stack.enter_context(local_cluster(*MONOLITHIC, log_path=str(log_dir / f"{name}.log"),
                                                  startup_timeout_s=args.startup_timeout_s, source=source))
            up[name] = {"url": c.url, "pid": c.proc.pid}
    return up


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", nargs="+", choices=("vllm", "pdserve", "pdserve@base"), default=["vllm", "pdserve"])
    p.add_argument("--lengths", default="160,700,1500,2400", type=lambda s: [int(n) for n in s.split(",")])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline-src", default=None, help="the checkout pdserve@base runs from")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--vllm-kv-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--bf16-dir", default=str(Path.home() / ".cache/pdserve/smollm2-135m-bf16"))
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--log-dir", default=f"/tmp/bench-prompt-ttft-{time.strftime('%Y%m%d-%H%M%S')}")
    args = p.parse_args()
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        up = start_servers(stack, args, log_dir)
        trees = {name: process_tree(u["pid"]) for name, u in up.items()}
        results = {}
        for name, u in up.items():
            with paused([pid for other, pids in trees.items() if other != name for pid in pids]):
                results[name] = measure(u["url"], args.lengths, args.repeats, random.Random(0))
    names = list(results)
    print(f"\nTTFT ms, one prompt at a time, medians of {args.repeats}; pdserve {source_info().get('commit')}\n")
    print("| prompt tokens | " + " | ".join(names) + " |\n|---:|" + "---:|" * len(names))
    for n in args.lengths:
        print(f"| {n:,} | " + " | ".join(f"{statistics.median(results[s][n]):,.0f}" for s in names) + " |")
    print(f"\nruns: { {s: {n: [round(t) for t in ts] for n, ts in r.items()} for s, r in results.items()} }")


if __name__ == "__main__":
    main()
