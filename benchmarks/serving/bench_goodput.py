"""Goodput of one workload over several layouts of the same cores: the share of requests that meet
both a TTFT and a TPOT target (DistServe's measure), per Poisson rate.

Layouts (every one on this machine's cores, one `pdserve up` each, started once and loaded at every
rate in turn; the same prompts and arrival times for every layout):

  pd-slo        1 prefill + 1 decode node, one thread each, --prefill-placement slo (per-request
                placement from load, the prefill node taking whole requests when the decode node
                has no room; nodes that decode cap their prefill chunks to hold the ITL target)
  pd-threshold  the same nodes with the threshold rule (--local-prefill-threshold only)
  mono-2x1      2 monolithic nodes, 1 thread each (no prefill nodes: each request runs whole)
  mono-1x2      1 monolithic node with 2 threads
  pd-2p2d-store 2 prefill + 2 decode nodes, one thread each, slo placement, the KV store

Workloads: random, decode-heavy and shared-prefix (below), and conversation: Mooncake's
conversation trace (--trace FILE; default the repository's 300-line slice) replayed as sessions,
--requests conversations started at the rate, each next turn its scaled think time after the
previous answer (pdserve.loadgen.trace_replay), with the cache share against its bounds.

    .venv/bin/python -m benchmarks.serving.bench_goodput --rates 0.5,1,2,4 --runs 3 --json goodput.json --plot goodput.png
    .venv/bin/python -m benchmarks.serving.bench_goodput --workload decode-heavy      # 64-token prompts, 256 out
    .venv/bin/python -m benchmarks.serving.bench_goodput --workload shared-prefix     # 4 prefixes of 384 tokens
    .venv/bin/python -m benchmarks.serving.bench_goodput --workload conversation --trace conversation_trace.jsonl

The default model is the CLI's (SmolLM2-135M-Instruct); `--model builtin:tiny` for a quick check.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import statistics

from benchmarks.support.cluster import local_cluster, source_info
from pdserve.loadgen.bench import BenchConfig, run_benchmark
from pdserve.loadgen.trace import TraceScale
from pdserve.models.gguf import DEFAULT_MODEL

LAYOUTS = {
    "pd-slo": ("--prefill-nodes", "1", "--decode-nodes", "1", "--threads-per-node", "1", "--prefill-placement", "slo",
               "--no-lend-idle-cores"),
    # The same, each step on the idle node's core too (pdserve.node.core_board).
    "pd-slo-lend": ("--prefill-nodes", "1", "--decode-nodes", "1", "--threads-per-node", "1",
                    "--prefill-placement", "slo", "--lend-idle-cores"),
    # pd-slo in push mode: the decode request goes out with the prefill request, and the prefill
    # node WRITEs the blocks into the decode node's as its chunks complete (docs/handover.md).
    "pd-slo-push": ("--prefill-nodes", "1", "--decode-nodes", "1", "--threads-per-node", "1",
                    "--prefill-placement", "slo", "--handover", "push", "--no-lend-idle-cores"),
    "mono-2x1": ("--prefill-nodes", "0", "--decode-nodes", "2", "--threads-per-node", "1"),
    "mono-1x2": ("--prefill-nodes", "0", "--decode-nodes", "1", "--threads-per-node", "2"),
    "pd-threshold": ("--prefill-nodes", "1", "--decode-nodes", "1", "--threads-per-node", "1",
                     "--prefill-placement", "threshold"),
    "pd-2p2d-store": ("--prefill-nodes", "2", "--decode-nodes", "2", "--threads-per-node", "1",
                      "--prefill-placement", "slo", "--kv-transfer", "store"),
}
TRACE_SLICE = os.path.join(os.path.dirname(__file__), "..", "traces", "mooncake_conversation_300.jsonl")
# The conversation trace shrunk so that 2 cores keep up: prompts of about 12k tokens become about
# 750 (blocks of 32 tokens), outputs of about 340 about 43 (at most 64), and the minutes between
# turns seconds (x 0.02).
CONVERSATION_SCALE = TraceScale(length_divisor=16, output_divisor=8, output_cap=64, time_scale=0.02)
WORKLOADS = {
    "random": dict(workload="random", input_len_min=128, input_len_max=512, output_len=32),
    "decode-heavy": dict(workload="random", input_len_min=64, input_len_max=64, output_len=256),
    "shared-prefix": dict(workload="shared-prefix", num_groups=4, prompts_per_group=6, prefix_len=384,
                          question_len=64, output_len=32),
    "conversation": dict(trace_sessions=True, trace_scale=CONVERSATION_SCALE),
}


def bench_config(url: str, args, rate: float, run: int) -> BenchConfig:
    trace = dict(trace=args.trace, trace_num_sessions=args.requests,
                 cache_capacity_tokens=args.cache_capacity_tokens) if args.workload == "conversation" else {}
    # Prompts differ from rate to rate (a rate repeating an earlier rate's prompts on the same
    # cluster was served from its prefix cache) and are the same for every layout.
    seed = run * 1000 + (round(rate * 100) if math.isfinite(rate) else 999)
    return BenchConfig(base_url=url, num_prompts=args.requests, request_rate=rate, seed=seed, num_warmup=0,
                       goodput_ttft_ms=args.ttft_slo_ms, goodput_tpot_ms=args.itl_slo_ms, disable_tqdm=True,
                       max_token_id=min(30000, args.vocab), **WORKLOADS[args.workload], **trace)


def measure(url: str, args, rate: float, run: int) -> dict:
    report = asyncio.run(run_benchmark(bench_config(url, args, rate, run)))
    sent = report["completed"] + report["failed"]
    good = round((report["goodput"] or 0.0) * report["duration_s"])
    return {"attainment": good / sent if sent else 0.0, "goodput_rps": report["goodput"],
            "failed": report["failed"], "ttft_p50_ms": report["p50_ttft_ms"], "ttft_p90_ms": report["p90_ttft_ms"],
            "tpot_p50_ms": report["p50_tpot_ms"], "tpot_p90_ms": report["p90_tpot_ms"],
            "cached_share": report.get("cached_token_share"), "bound_optimal": report.get("cache_bound_optimal"),
            "bound_infinite": report.get("cache_bound_infinite"),
            "stages_mean_ms": {k: round(v["mean_ms"], 1) for k, v in (report.get("ttft_breakdown") or {}).items()}}


def warm_up(url: str, args) -> None:
    """Two requests of the workload's config, untimed: first steps, the nodes' first cost
    measurements. A trace warms up on random prompts of its config's lengths (no trace entry is
    used up)."""
    cfg = bench_config(url, args, math.inf, 1000)
    warm = dataclasses.replace(cfg, num_prompts=2, trace=None,
                               workload="random" if cfg.workload == "trace" else cfg.workload)
    asyncio.run(run_benchmark(warm))


def run_layout(name: str, args) -> dict[float, list[dict]]:
    transfer = () if "--kv-transfer" in LAYOUTS[name] else ("--kv-transfer", "nixl")
    flags = LAYOUTS[name] + ("--model", args.model, "--ttft-slo-ms", str(args.ttft_slo_ms),
                             "--itl-slo-ms", str(args.itl_slo_ms), *transfer)
    out: dict[float, list[dict]] = {}
    log_path = os.path.join(args.log_dir, f"goodput-{name}.log")
    with local_cluster(*flags, log_path=log_path) as c:
        if args.workload == "conversation" and args.cache_capacity_tokens is None:
            args = argparse.Namespace(**{**vars(args), "cache_capacity_tokens": kv_capacity_tokens(c)})
        warm_up(c.url, args)
        for rate in args.rates:
            for run in range(args.runs):
                before, lends = c.health().get("failover", {}), _lend_counters(c)
                row = measure(c.url, args, rate, run)
                after = c.health().get("failover", {})
                row.update({k: after.get(k, 0) - before.get(k, 0) for k in ("placed_local", "placed_remote", "placed_whole")})
                row.update({k: v - lends[k] for k, v in _lend_counters(c).items()})
                out.setdefault(rate, []).append(row)
                print(f"{name} rate {rate} run {run}: {json.dumps(row)}", flush=True)
    return out


LEND_COUNTERS = ("kv_tokens_borrowed", "kv_borrow_failures", "kv_borrow_wait_us")


def _lend_counters(c) -> dict[str, int]:
    """Push mode's lends, summed over the nodes: tokens READ from a decode node instead of
    computed, prompts that awaited a lend and computed it, and how long they waited for targets."""
    nodes = c.nodes().values()
    return {k: sum(int(n.get(k, 0)) for n in nodes) for k in LEND_COUNTERS}


def kv_capacity_tokens(c, block_size: int = 16) -> int:
    """The layout's KV capacity: every node's paged cache (the CLI's default block size)."""
    return sum(n.get("total_blocks", 0) for n in c.nodes().values()) * block_size


def median_row(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows if r[k] is not None)
            if any(r[k] is not None for r in rows) else None for k in rows[0] if k != "stages_mean_ms"}


def table(results: dict[str, dict[float, list[dict]]], rates: list[float]) -> str:
    lines = ["| layout | " + " | ".join(f"{r:g} req/s" for r in rates) + " |",
             "|---|" + "---|" * len(rates)]
    for name, by_rate in results.items():
        cells = []
        for rate in rates:
            m = median_row(by_rate[rate])
            extra = f", {m['placed_local']:.0f} local, {m['placed_whole']:.0f} whole" if name == "pd-slo" else ""
            if m.get("cached_share") is not None:
                extra += f", cached {m['cached_share']:.1%}"
                if m.get("bound_optimal") is not None:  # (a trace's bound; other workloads have none)
                    extra += f" of optimal {m['bound_optimal']:.1%}"
            cells.append(f"{m['attainment']:.1%} (TTFT p50 {m['ttft_p50_ms'] / 1e3:.2f} s, "
                         f"TPOT p90 {m['tpot_p90_ms']:.0f} ms{extra})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, rates: list[float], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, by_rate in results.items():
        ax.plot(rates, [median_row(by_rate[r])["attainment"] * 100 for r in rates], "o-", label=name)
    ax.set(xlabel="request rate (req/s)", ylabel="requests within both targets (%)", xscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--vocab", type=int, default=49152, help="random token ids stay below min(30000, this)")
    p.add_argument("--workload", choices=list(WORKLOADS), default="random")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--rates", default="0.5,1,2,4")
    p.add_argument("--runs", type=int, default=3, help="repeats per rate (medians are reported)")
    p.add_argument("--requests", type=int, default=24, help="requests per rate and run")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--itl-slo-ms", type=float, default=100.0)
    p.add_argument("--trace", default=TRACE_SLICE, help="conversation: the Mooncake trace file")
    p.add_argument("--cache-capacity-tokens", type=int, default=None,
                   help="conversation: the cluster's KV capacity in tokens, for the optimal cache's bound")
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    results = {}
    for name in args.layouts.split(","):
        results[name] = run_layout(name, args)
        print(table(results, args.rates), flush=True)
        if args.json:  # after every layout: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"source": source_info(), "args": vars(args), "load": os.getloadavg(),
                           "results": {n: {str(r): rows for r, rows in v.items()} for n, v in results.items()}},
                          f, indent=2)
    if args.plot:
        plot(results, args.rates, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
