"""Multi-round chat on `pdserve up` 2P2D: routing policies, conditional disaggregation and
prefix caching A/B on the same trace, and the simulator's prediction for that trace.

The trace is pdserve.sim's (so the simulator replays exactly the same prompts): each user opens
with a long prompt, then each round resends the whole conversation (token ids, with the model's
real replies) plus a new turn. Reports the share of prompt tokens served from cache (all
rounds, and follow-ups' history), handovers, KV bytes moved between nodes, and TTFT p50.

    .venv/bin/python -m benchmarks.serving.bench_routing --users 10 --rounds 5 --repeats 3
    .venv/bin/python -m benchmarks.serving.bench_routing --configs cache_aware --simulate   # model check
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import statistics
import time

import openai

from pdserve.sim.trace import Session, TraceConfig, make_trace
from pdserve.testing.up_cluster import node_stats, running_cluster

CONFIGS = {
    "round_robin": ("--prefill-policy", "round_robin", "--decode-policy", "round_robin"),
    "least_loaded": ("--prefill-policy", "least_loaded", "--decode-policy", "least_loaded"),
    "cache_aware": (),
    "cache_aware+local<=96": ("--local-prefill-threshold", "96"),
    "no_prefix_caching": ("--no-enable-prefix-caching",),
}
CORES = 2  # the 4 nodes share this machine's cores (the simulator models that)
CLUSTER = ("--kv-transfer", "nixl", "--prefill-nodes", "2", "--decode-nodes", "2", "--num-kv-blocks", "1024")


def trace(users: int, rounds: int) -> list[Session]:
    return make_trace(TraceConfig(sessions=users, rounds=rounds, system_prompts=users, system_prompt_tokens=160,
                                  first_turn_tokens=48, turn_tokens=48, output_tokens=16, arrival_rate=0,
                                  think_time_s=0, vocab=250, seed=1))


def run_user(url: str, session: Session) -> list[dict]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    history, rows = list(session.system), []
    for rnd, turn in enumerate(session.turns):
        prompt = history + turn
        t0 = time.perf_counter()
        ttft, ids, cached = None, [], 0
        for chunk in client.completions.create(model="builtin:tiny", prompt=prompt, stream=True, temperature=0,
                                               max_tokens=len(session.outputs[rnd]),
                                               stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True, "return_token_ids": True}):
            if chunk.choices and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.choices:
                ids += chunk.choices[0].model_extra.get("token_ids") or []
            if chunk.usage is not None and chunk.usage.prompt_tokens_details:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
        rows.append({"round": rnd, "prompt": len(prompt), "history": len(history) if rnd else 0,
                     "cached": cached, "ttft": ttft})
        history = prompt + ids
    return rows


def _cluster_totals(url: str) -> dict:
    stats = node_stats(url).values()
    costs = [s["prefill_ns_per_token"] / 1e9 for s in stats if s.get("prefill_ns_per_token")]
    return {"handovers": sum(s["requests_total"] for s in stats if s["role"] == "prefill"),
            "bytes": sum(s.get("transfer_bytes_nixl", 0) + s.get("transfer_bytes_store", 0) for s in stats),
            "prefill_s_per_token": statistics.median(costs) if costs else 0.0}


def measure(flags: tuple, sessions: list[Session]) -> dict:
    with running_cluster(*CLUSTER, *flags) as (url, _):
        before = _cluster_totals(url)
        with cf.ThreadPoolExecutor(len(sessions)) as pool:
            rows = [r for f in [pool.submit(run_user, url, s) for s in sessions] for r in f.result()]
        time.sleep(0.5)  # the last pongs carry the final counters
        after = _cluster_totals(url)
    follow = [r for r in rows if r["round"]]
    return {"hit": sum(r["cached"] for r in rows) / sum(r["prompt"] for r in rows),
            "history_hit": sum(min(r["cached"], r["history"]) for r in follow) / sum(r["history"] for r in follow),
            "handovers": after["handovers"] - before["handovers"], "requests": len(rows),
            "moved_mb": (after["bytes"] - before["bytes"]) / 1e6,
            "prefill_s_per_token": after["prefill_s_per_token"],
            "ttft_p50_ms": 1e3 * statistics.median(r["ttft"] for r in rows),
            "followup_ttft_p50_ms": 1e3 * statistics.median(r["ttft"] for r in follow)}


def simulated(flags: tuple, sessions: list[Session], costs_path: str | None, prefill_s_per_token: float = 0.0
              ) -> dict:
    """The simulator on the same trace and cluster shape: costs calibrated on this machine, with
    the prefill cost the real cluster's nodes measured during the run when there is one."""
    from pdserve.sim.costs import NodeCosts, calibrate
    from pdserve.sim.report import summarize
    from pdserve.sim.simulator import ClusterSpec, Simulator
    costs = NodeCosts.load(costs_path) if costs_path else calibrate()
    if prefill_s_per_token:
        costs = dataclasses.replace(costs, prefill_s_per_token=prefill_s_per_token)
    opts = dict(zip(flags[::2], flags[1::2]))
    spec = ClusterSpec(2, 2, kv_blocks=1024, transfer="nixl", cores=CORES,
                       prefill_policy=opts.get("--prefill-policy", "cache_aware"),
                       decode_policy=opts.get("--decode-policy", "cache_aware"),
                       local_prefill_threshold=int(opts.get("--local-prefill-threshold", 0)),
                       prefix_caching="--no-enable-prefix-caching" not in flags)
    s = summarize("sim", Simulator(spec, costs, sessions).run(), costs.block_bytes)
    return {"hit": s.hit_rate, "handovers": s.handovers, "moved_mb": s.moved_mb, "ttft_p50_ms": s.ttft_p50_ms}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--simulate", action="store_true", help="also print the simulator's prediction per config")
    ap.add_argument("--costs", default=None, help="NodeCosts JSON for --simulate (default: calibrate now)")
    args = ap.parse_args()
    sessions = trace(args.users, args.rounds)
    print("| config | prompt tokens from cache | history from cache | handovers | KV moved MB "
          "| TTFT p50 ms | follow-up TTFT p50 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.configs.split(","):
        runs = [measure(CONFIGS[name], sessions) for _ in range(args.repeats)]
        med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
        print(f"| {name} | {med('hit'):.0%} | {med('history_hit'):.0%} | {med('handovers'):.0f} / {runs[0]['requests']} "
              f"| {med('moved_mb'):.1f} | {med('ttft_p50_ms'):.1f} | {med('followup_ttft_p50_ms'):.1f} |", flush=True)
        if args.simulate:
            s = simulated(CONFIGS[name], sessions, args.costs, med("prefill_s_per_token"))
            print(f"| {name} (simulated) | {s['hit']:.0%} | | {s['handovers']} | {s['moved_mb']:.1f} "
                  f"| {s['ttft_p50_ms']:.1f} | |", flush=True)


if __name__ == "__main__":
    main()
