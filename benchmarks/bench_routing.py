"""Multi-round chat on `pdserve up` 2P2D over NIXL: routing policies and conditional
disaggregation A/B on the same trace. Each user opens with a long prompt, then each round resends
the whole conversation (token ids) plus a new turn. Reports the share of history tokens served
from cache, follow-up handovers, and follow-up TTFT p50.

    .venv/bin/python benchmarks/bench_routing.py --users 6 --rounds 4
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from cluster_util import node_stats, running_cluster  # noqa: E402

CONFIGS = {
    "round_robin": ("--prefill-policy", "round_robin", "--decode-policy", "round_robin"),
    "cache_aware": (),
    "cache_aware+local<=96": ("--local-prefill-threshold", "96"),
}


def run_user(url: str, user: int, rounds: int, turn: int, answer: int) -> list[tuple[int, int, float]]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    history = [(user * 31 + i) % 200 + 20 for i in range(160)]
    out = []
    for rnd in range(rounds):
        prompt = history + [(7 * user + 13 * rnd + i) % 200 + 20 for i in range(turn)]
        t0 = time.perf_counter()
        ttft, ids = None, []
        for chunk in client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=answer, stream=True,
                                               temperature=0, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True, "return_token_ids": True}):
            if chunk.choices and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.choices:
                ids += chunk.choices[0].model_extra.get("token_ids") or []
            if chunk.usage is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens if chunk.usage.prompt_tokens_details else 0
        if rnd:
            out.append((len(history), cached, ttft))
        history = prompt + ids
    return out


def measure(name: str, flags: tuple, users: int, rounds: int) -> dict:
    with running_cluster("--kv-transfer", "nixl", "--prefill-nodes", "2", "--decode-nodes", "2",
                         "--num-kv-blocks", "1024", *flags) as (url, _):
        before = sum(s["requests_total"] for s in node_stats(url).values() if s["role"] == "prefill")
        with cf.ThreadPoolExecutor(users) as pool:
            rows = [r for f in [pool.submit(run_user, url, u, rounds, 48, 16) for u in range(users)] for r in f.result()]
        time.sleep(0.5)
        handovers = sum(s["requests_total"] for s in node_stats(url).values() if s["role"] == "prefill") - before
    history = sum(h for h, _, _ in rows)
    return {"config": name, "history_hit": sum(min(c, h) for h, c, _ in rows) / history,
            "prefill_node_requests": handovers, "requests": users * rounds,
            "followup_ttft_p50_ms": 1e3 * statistics.median(t for _, _, t in rows)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    print("| config | history tokens from cache | requests through a prefill node | follow-up TTFT p50 ms |")
    print("|---|---:|---:|---:|")
    for name, flags in CONFIGS.items():
        runs = [measure(name, flags, args.users, args.rounds) for _ in range(args.repeats)]
        med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
        print(f"| {name} | {med('history_hit'):.0%} | {med('prefill_node_requests'):.0f} / {runs[0]['requests']} "
              f"| {med('followup_ttft_p50_ms'):.1f} |", flush=True)


if __name__ == "__main__":
    main()
