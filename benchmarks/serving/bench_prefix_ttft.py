"""Cold against warm TTFT at a long shared prefix, on 2 prefill + 2 decode nodes with Redis.

    .venv/bin/python -m benchmarks.serving.bench_prefix_ttft [--prefix-len 2048] [--trials 5]
        [--redis-cluster]   # also the same cluster over a 3-master + 3-replica Redis Cluster
        [--back-to-back]    # send the warm request when the cold stream ends, without waiting for idle nodes
        [--model SmolLM2-135M-Instruct]  # any model pdserve serves, instead of the bench model

The ~32M bench model (benchmarks/support/bench_model.py, with the byte tokenizer). Each trial
draws a fresh prefix; the cold request is prefix + question A (nothing cached anywhere), the warm
one is prefix + question B, sent once every node is idle again: a new user, arriving after the
cold request's 2 tokens have been streamed and its decode node has loaded the prefix. TTFT is the
time to the first streamed token, seen by one keep-alive client (a new httpx client per request
costs ~16 ms of TLS set-up inside the timing). Each request's stream is read to its end: a client
that leaves at its first token aborts the request, and its decode node then drops the prefix it
was loading. The store is the private redis-server `pdserve up` starts, and with --redis-cluster
also a Redis Cluster of 3 masters and 3 replicas on loopback (`--store redis-cluster://...`).
Configs run side by side on the same machine:
  disaggregated   every prompt goes through a prefill node (which finds the prefix in its cache
                  or in Redis) and is handed over to a decode node
  local tail      --local-prefill-threshold 128: the decode node that holds the prefix computes
                  the 64-token question itself, with no handover
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from benchmarks.support.bench_model import build_served_model
from benchmarks.support.cluster import local_cluster, source_info, ttft_ms
from pdserve.testing.redis_cluster import redis_cluster

CONFIGS = {"disaggregated": ["--local-prefill-threshold", "0"], "local tail": ["--local-prefill-threshold", "128"]}
IDLE_TIMEOUT_S = 30.0
PONG_WAIT_S = 0.5


def node_stats(client: httpx.Client, url: str) -> dict[str, dict]:
    return {n["id"]: n for n in client.get(f"{url}/health", timeout=10).json()["nodes"]}


def wait_idle(client: httpx.Client, url: str) -> dict[str, dict]:
    """Node stats once no node holds a request or a KV block. Nodes report in their pongs (every
    0.2 s), so it first waits out two of them: a report from before the last request says idle."""
    time.sleep(PONG_WAIT_S)
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        nodes = node_stats(client, url)
        if all(n.get("running", 0) == n.get("waiting", 0) == n.get("kv_blocks_in_use", 0) == 0
               and n.get("routed_requests", 0) == 0 for n in nodes.values()):
            return nodes
        time.sleep(0.05)
    raise RuntimeError(f"the cluster was still busy after {IDLE_TIMEOUT_S:.0f} s")


def stored_bytes(before: dict[str, dict], after: dict[str, dict]) -> int:
    """Bytes the prefill nodes wrote to the store in between (their handovers' puts)."""
    return sum(n.get("transfer_bytes_store", 0) - before[i].get("transfer_bytes_store", 0)
               for i, n in after.items() if n["role"] == "prefill")


def run_config(model: Path | str, flags: list[str], args, store: str | None, seed: int) -> list[dict]:
    """seed: each run draws prefixes of its own (a Redis Cluster serves several runs)."""
    cluster_flags = ["--model", str(model), "--prefill-nodes", "2", "--decode-nodes", "2",
                     "--kv-transfer", "store", "--num-kv-blocks", "2048", *flags]
    if store is not None:
        cluster_flags += ["--store", store]
    trials = []
    with local_cluster(*cluster_flags) as c, httpx.Client() as client:
        model_id = client.get(f"{c.url}/v1/models", timeout=10).json()["data"][0]["id"]
        rng = random.Random(seed)
        question = lambda: [rng.randrange(3, 258) for _ in range(args.question_len)]  # noqa: E731
        ttft_ms(client, c.url, model_id, question() * 4)  # warm-up: connections, kernels
        for _ in range(args.trials):
            prefix = [rng.randrange(3, 258) for _ in range(args.prefix_len)]
            wait_idle(client, c.url)
            cold = ttft_ms(client, c.url, model_id, prefix + question())
            before = node_stats(client, c.url) if args.back_to_back else wait_idle(client, c.url)
            warm = ttft_ms(client, c.url, model_id, prefix + question())
            put = stored_bytes(before, wait_idle(client, c.url))
            trials.append({"cold_ms": cold, "warm_ms": warm, "warm_put_bytes": put})
            print(f"  cold {cold:.0f} ms, warm {warm:.1f} ms, warm handover wrote {put / 1e6:.2f} MB", flush=True)
    return trials


@contextlib.contextmanager
def store_url(name: str) -> Iterator[str | None]:
    if name == "redis-cluster":
        with redis_cluster(masters=3, replicas=1) as cluster:
            yield cluster.url
    else:
        yield None  # pdserve up starts its own redis-server


def summarize(trials: list[dict]) -> dict:
    cold = statistics.median(t["cold_ms"] for t in trials)
    warm = statistics.median(t["warm_ms"] for t in trials)
    ratios = [t["warm_ms"] / t["cold_ms"] for t in trials]
    return {"cold_ms": cold, "warm_ms": warm, "warm_over_cold": warm / cold,
            "worst_warm_over_cold": max(ratios),
            "warm_put_mb": statistics.median(t["warm_put_bytes"] for t in trials) / 1e6, "trials": trials}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--redis-cluster", action="store_true",
                    help="also run on a Redis Cluster of 3 masters + 3 replicas (redis-cluster://)")
    ap.add_argument("--back-to-back", action="store_true",
                    help="send the warm request when the cold one's stream ends, not once every node is idle")
    ap.add_argument("--model", default=None,
                    help="a model pdserve serves (e.g. SmolLM2-135M-Instruct, the default GGUF); default: the ~32M bench model")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    model = args.model or build_served_model(Path(tempfile.mkdtemp()) / "llama-32m")
    rows: dict[str, dict] = {}
    for store in ["redis", "redis-cluster"] if args.redis_cluster else ["redis"]:
        with store_url(store) as url:
            for name, flags in CONFIGS.items():
                print(f"{store}, {name}:", flush=True)
                rows[f"{store}, {name}"] = summarize(run_config(model, flags, args, url, seed=len(rows)))
    print(f"\n{args.prefix_len}-token shared prefix + {args.question_len}-token question, 2P2D, medians of "
          f"{args.trials} trials, load average {os.getloadavg()[0]:.2f}\n")
    print("| store, config | cold TTFT ms | warm TTFT ms | warm / cold | worst trial | warm handover put MB |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['cold_ms']:.0f} | {r['warm_ms']:.1f} | 1/{1 / r['warm_over_cold']:.1f} | "
              f"1/{1 / r['worst_warm_over_cold']:.1f} | {r['warm_put_mb']:.2f} |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"source": source_info(), "args": vars(args), "rows": rows},
                                                     indent=1))


if __name__ == "__main__":
    main()
