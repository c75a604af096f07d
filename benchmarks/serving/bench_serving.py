"""P/D over NIXL vs P/D over the store (default LMCache, and direct Redis) vs monolithic.

    .venv/bin/python -m benchmarks.serving.bench_serving [--model builtin:tiny] [--repeats 3] \
        [--output-json benchmarks/results/bench_serving.json]

For each repeat, each config is started in turn with `pdserve up` (127.0.0.1 only), warmed up,
measured with pdserve.loadgen.bench on every workload, then stopped (SIGTERM to `pdserve up`, waited).
Configs are interleaved across repeats (a, b, c, a, b, c, ...) so slow drift on a shared machine
does not favour one config. Every workload of repeat r uses the same seed in every config, and
a different seed per repeat, so a repeat never hits the prefix cache warmed by the previous one.

  pd-nixl     --prefill-nodes 1 --decode-nodes 1 --kv-transfer nixl
  pd-store    --prefill-nodes 1 --decode-nodes 1 --kv-transfer store   (the default store: LMCache
              tiers over resp://, 256-token chunks; starts its own redis-server)
  pd-direct-redis  the same with --store direct+redis:// (pdserve's direct Redis client, the baseline)
  monolithic  --prefill-nodes 0 --decode-nodes 1                        (decode node runs whole requests)

Prints two markdown tables: medians over repeats, and ratios vs monolithic. Token ids are drawn
from [--min-token-id, --max-token-id) (builtin:tiny has 261 ids: the default 250 fits it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.support.cluster import ClusterError, local_cluster, source_info
from pdserve.loadgen.bench import BenchConfig, run_benchmark

CONFIGS: dict[str, list[str]] = {
    "pd-nixl": ["--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "nixl"],
    "pd-store": ["--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "store"],
    "pd-direct-redis": ["--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "store",
                        "--store", "direct+redis://"],
    "monolithic": ["--prefill-nodes", "0", "--decode-nodes", "1"],
}
WORKLOADS = ("random", "shared-prefix")
# (column title, metrics key, format); None formats as "-".
COLUMNS = [
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("TTFT p50 ms", "p50_ttft_ms", "{:.1f}"),
    ("TTFT p99 ms", "p99_ttft_ms", "{:.1f}"),
    ("TPOT p50 ms", "p50_tpot_ms", "{:.2f}"),
    ("TPOT p99 ms", "p99_tpot_ms", "{:.2f}"),
    ("ITL p50 ms", "p50_itl_ms", "{:.2f}"),
    ("e2e p50 ms", "p50_e2e_ms", "{:.1f}"),
    ("e2e p99 ms", "p99_e2e_ms", "{:.1f}"),
]
RATIO_COLUMNS = [c for c in COLUMNS if c[1] != "p50_itl_ms"]
NODE_COUNTERS = ("requests_total", "transfers_ok", "transfers_failed", "leases_expired")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=48, help="random workload")
    p.add_argument("--input-len-min", type=int, default=64)
    p.add_argument("--input-len-max", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-groups", type=int, default=4, help="shared-prefix workload")
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--min-token-id", type=int, default=100)
    p.add_argument("--max-token-id", type=int, default=250, help="exclusive; builtin:tiny has 261 ids")
    p.add_argument("--warmup-prompts", type=int, default=16)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--run-timeout-s", type=float, default=600.0, help="one workload run, whole")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--up-flag", action="append", default=[], dest="up_flags",
                   help="extra flag for every `pdserve up` (repeat; e.g. --up-flag=--kernel-backend=torch)")
    p.add_argument("--log-dir", default=None, help="where each cluster's log goes (default: a temp dir)")
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def bench_config(args: argparse.Namespace, url: str, workload: str, seed: int, **over: Any) -> BenchConfig:
    cfg = dict(base_url=url, model=None, workload=workload, num_prompts=args.num_prompts,
               input_len_min=args.input_len_min, input_len_max=args.input_len_max,
               output_len=args.output_len, num_groups=args.num_groups,
               prompts_per_group=args.prompts_per_group, prefix_len=args.prefix_len,
               question_len=args.question_len, min_token_id=args.min_token_id,
               max_token_id=args.max_token_id, concurrency=args.concurrency, num_warmup=0, seed=seed,
               temperature=0.0, timeout_s=args.request_timeout_s, disable_tqdm=True)
    cfg.update(over)
    return BenchConfig(**cfg)


def counters(c) -> dict[str, dict[str, int]]:
    """Node counters as of now: /health shows each node's last Pong, sent every 0.5 s, so wait
    past one ping interval first (outside the timed region)."""
    time.sleep(1.2)
    health = c.health()
    return {n["id"]: {k: int(n.get(k, 0)) for k in NODE_COUNTERS} for n in health.get("nodes", [])}


def counter_delta(before: dict, after: dict) -> dict[str, dict[str, int]]:
    return {node: {k: v - before.get(node, {}).get(k, 0) for k, v in vals.items()}
            for node, vals in after.items()}


async def timed_run(cfg: BenchConfig, timeout_s: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        report = await asyncio.wait_for(run_benchmark(cfg), timeout_s)
    except asyncio.TimeoutError:
        return {"hung": True, "error": f"run did not finish within {timeout_s:.0f} s",
                "wall_s": time.perf_counter() - t0}
    report["wall_s"] = time.perf_counter() - t0
    return report


def run_one_cluster(args, name: str, repeat: int, log_dir: Path) -> dict[str, Any]:
    flags = ["--model", args.model, *CONFIGS[name], *args.up_flags]
    log_path = str(log_dir / f"{name}-r{repeat}.log")
    entry: dict[str, Any] = {"config": name, "repeat": repeat, "flags": flags, "log": log_path,
                             "workloads": {}}
    print(f"[{time.strftime('%H:%M:%S')}] {name} repeat {repeat}: starting", flush=True)
    try:
        with local_cluster(*flags, log_path=log_path, startup_timeout_s=args.startup_timeout_s) as c:
            entry["startup_s"] = c.startup_s
            entry["health_at_start"] = c.health()
            # Warm-up (untimed, own seeds): kernels, batch shapes, prefix-cache hits, KV handover.
            warm = [bench_config(args, c.url, "random", 900_000 + repeat,
                                 num_prompts=max(args.warmup_prompts, args.concurrency), output_len=8),
                    bench_config(args, c.url, "shared-prefix", 900_100 + repeat, num_groups=1,
                                 prompts_per_group=args.concurrency, output_len=8)]
            entry["warmup"] = []
            for cfg in warm:
                rep = asyncio.run(timed_run(cfg, args.run_timeout_s))
                entry["warmup"].append({k: rep.get(k) for k in ("completed", "failed", "wall_s",
                                                                 "errors", "hung", "error")})
            for wi, workload in enumerate(args.workloads):
                before = counters(c)
                cfg = bench_config(args, c.url, workload, 100 * repeat + wi)
                rep = asyncio.run(timed_run(cfg, args.run_timeout_s))
                rep["node_counters"] = counter_delta(before, counters(c))
                entry["workloads"][workload] = rep
                print(f"[{time.strftime('%H:%M:%S')}]   {workload}: completed={rep.get('completed')} "
                      f"failed={rep.get('failed')} req/s={rep.get('request_throughput', 0):.2f} "
                      f"TTFT p50={rep.get('p50_ttft_ms') or 0:.1f} ms wall={rep['wall_s']:.1f} s"
                      + (f" ERROR {rep.get('error')}" if rep.get("hung") else "")
                      + (f" first error: {rep['errors'][0]}" if rep.get("errors") else ""), flush=True)
        entry.update(stop_s=c.stop_s, stopped_cleanly=c.stopped_cleanly, up_returncode=c.up_returncode,
                     leftover_pids=c.leftover_pids)
        if not c.stopped_cleanly or c.leftover_pids or c.up_returncode != 0:
            print(f"  !! {name}: stop was not clean (returncode={c.up_returncode}, "
                  f"leftover pids={c.leftover_pids}); log: {log_path}", flush=True)
    except ClusterError as exc:
        entry["error"] = str(exc)
        print(f"  !! {name}: {exc}", flush=True)
    return entry


def median_metrics(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"repeats": len(runs)}
    ok = [r for r in runs if not r.get("hung")]
    for _, key, _ in COLUMNS:
        vals = [r[key] for r in ok if r.get(key) is not None]
        out[key] = statistics.median(vals) if vals else None
    out["failed"] = sum(r.get("failed", 0) for r in ok)
    out["completed"] = sum(r.get("completed", 0) for r in ok)
    out["hung"] = len(runs) - len(ok)
    xfer_ok = xfer_failed = 0
    for r in ok:
        for node, vals in r.get("node_counters", {}).items():
            if node.startswith("decode"):  # the pulling side; a prefill node counts its releases
                xfer_ok += vals["transfers_ok"]
                xfer_failed += vals["transfers_failed"]
    out["kv_transfers_ok"], out["kv_transfers_failed"] = xfer_ok, xfer_failed
    return out


def _fmt(fmt: str, v: Any) -> str:
    return "-" if v is None else fmt.format(v)


def tables(summary: dict[str, dict[str, dict[str, Any]]], configs: list[str], workloads: list[str]) -> str:
    head = ["config", "workload", *[c[0] for c in COLUMNS], "ok/failed", "KV xfers ok/failed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in workloads:
        for name in configs:
            m = summary.get(name, {}).get(w)
            if m is None:
                continue
            cells = [name, w, *[_fmt(f, m.get(k)) for _, k, f in COLUMNS],
                     f"{m['completed']}/{m['failed']}" + (f" ({m['hung']} hung)" if m["hung"] else ""),
                     "-" if name == "monolithic" else f"{m['kv_transfers_ok']}/{m['kv_transfers_failed']}"]
            lines.append("| " + " | ".join(cells) + " |")
    out = "\n".join(lines)
    if "monolithic" in configs:
        head = ["config", "workload", *[c[0] for c in RATIO_COLUMNS]]
        rl = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for w in workloads:
            base = summary.get("monolithic", {}).get(w)
            for name in configs:
                m = summary.get(name, {}).get(w)
                if m is None or base is None or name == "monolithic":
                    continue
                cells = [name, w]
                for _, k, _ in RATIO_COLUMNS:
                    a, b = m.get(k), base.get(k)
                    cells.append("-" if a is None or not b else f"{a / b:.2f}x")
                rl.append("| " + " | ".join(cells) + " |")
        out += ("\n\nRatios vs monolithic (same workload; >1 is higher: better for req/s and tok/s, "
                "worse for latencies):\n\n" + "\n".join(rl))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)  # so the running cluster is stopped by the finally
    log_dir = Path(args.log_dir or f"/tmp/pdserve-bench-serving-{time.strftime('%Y%m%d-%H%M%S')}")
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    entries = []
    for r in range(args.repeats):
        for name in args.configs:
            entries.append(run_one_cluster(args, name, r, log_dir))
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for name in args.configs:
        for w in args.workloads:
            runs = [e["workloads"][w] for e in entries if e["config"] == name and w in e["workloads"]]
            if runs:
                summary.setdefault(name, {})[w] = median_metrics(runs)
    text = tables(summary, args.configs, args.workloads)
    print()
    print(f"Medians over {args.repeats} repeats; model {args.model}; concurrency {args.concurrency}; "
          f"output {args.output_len} tokens (ignore_eos); total wall {time.monotonic() - t0:.0f} s; "
          f"pdserve {source_info().get('commit')}")
    print()
    print(text)
    unclean = [(e["config"], e["repeat"]) for e in entries
               if e.get("error") or not e.get("stopped_cleanly", True) or e.get("leftover_pids")
               or e.get("up_returncode") not in (0, None)]
    if unclean:
        print(f"\nclusters that failed or did not stop cleanly: {unclean} (logs in {log_dir})")
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "source": source_info(), "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                       "platform": platform.platform()},
                       "summary": summary, "runs": entries, "table": text}, f, indent=2, default=str)
    return 0 if all(not e.get("error") for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main())
