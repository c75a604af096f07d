"""P/D against P/D: vLLM CPU's own disaggregated mode beside pdserve's 1P1D, on the Mooncake
conversation replay (bench_goodput's `conversation` workload: the same sessions, turns and
arrival times for every server), one core a role for both.

    .venv/bin/python -m benchmarks.peers.bench_vs_vllm_pd --rates 0.5,1 --runs 3 --requests 16

Servers, all up for the whole run, bound to 127.0.0.1, measured in turn (for each rate, each run,
each server) while the others are stopped (SIGSTOP):

  vllm-pd          two `python -m vllm.entrypoints.openai.api_server` on the bf16 directory
                   (`bench_vs_vllm`'s), each with `--kv-transfer-config` NixlConnector and
                   `kv_buffer_device` cpu: the prefill server's engine bound to core 0, the decode
                   server's to the last core (VLLM_CPU_OMP_THREADS_BIND; --vllm-pd-cores shared:
                   both on every core, which did not start in 600 s on 2), their NIXL side channels on
                   127.0.0.1; and benchmarks/peers/vllm_pd_proxy.py in front (vLLM's example proxy:
                   prefill with max_tokens 1, then decode with the blocks' kv_transfer_params)
  vllm             one vLLM server with every core (the monolithic peer)
  pdserve-pd       `pdserve up --prefill-nodes 1 --decode-nodes 1 --kv-transfer nixl
                   --no-lend-idle-cores` on the default model (the GGUF), one core a node, every
                   other flag at its default
                   (--tell-targets: also the run's TTFT and ITL targets, --ttft-slo-ms and
                   --itl-slo-ms, which its placement and chunking read; vLLM has no such setting)
  pdserve-pd-bf16  the same on vLLM's bf16 directory
  pdserve-pd-lend  pdserve-pd lending cores, as by default (a step borrows the idle node's core)
  pdserve-mono     `pdserve up --prefill-nodes 0 --decode-nodes 1 --threads-per-node N` (monolithic, every core)

Per cell: goodput attainment (requests within both targets), TTFT p50/p90, TPOT p50/p90 and the
share of prompt tokens served from a cache; medians of the runs. vLLM's venv: docs/benchmarks/vs-vllm.md,
plus `pip install nixl` there (its NixlConnector imports it).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from benchmarks.peers.bench_vs_llamacpp import load_average, paused, process_tree
from benchmarks.peers.bench_vs_vllm import DEFAULT_VLLM_PYTHON, bf16_checkpoint, vllm_command, vllm_env
from benchmarks.serving.bench_goodput import TRACE_SLICE, measure, warm_up
from benchmarks.support.cluster import local_cluster, peer_server, source_info
from pdserve.models.gguf import DEFAULT_MODEL
from pdserve.wire.transport import free_port

PD_NODES = ("--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "nixl")
PD = (*PD_NODES, "--no-lend-idle-cores")  # one core a node, as measured before lending was the default
PDSERVE = {"pdserve-pd": PD, "pdserve-pd-bf16": PD, "pdserve-pd-lend": (*PD_NODES, "--lend-idle-cores"),
           "pdserve-mono": ("--prefill-nodes", "0", "--decode-nodes", "1", "--threads-per-node", str(os.cpu_count() or 2))}
SERVERS = ("vllm-pd", "vllm", *PDSERVE)
NIXL_CONNECTOR = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}  # and the server's kv_role


def vllm_pd(stack: contextlib.ExitStack, args, model_dir: Path, log_dir: Path) -> dict:
    """vLLM's prefill server on core 0, its decode server on core 1, the proxy in front."""
    urls, pids = {}, []
    last = (os.cpu_count() or 2) - 1
    cores = {"prefill": "0", "decode": str(last)} if args.vllm_pd_cores == "split" else \
        {"prefill": f"0-{last}", "decode": f"0-{last}"}
    for role, core in cores.items():
        port = free_port()
        connector = dict(NIXL_CONNECTOR, kv_role="kv_producer" if role == "prefill" else "kv_consumer")
        cmd = vllm_command(args, model_dir, port, max_model_len=args.max_model_len,
                           extra=("--kv-transfer-config", json.dumps(connector)))
        env = vllm_env(args, core, VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                       VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
        urls[role], pid = stack.enter_context(peer_server(f"vllm-{role}", cmd, port, log_dir / f"vllm-{role}.log",
                                                          args.startup_timeout_s, env=env))
        pids.append(pid)
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.peers.vllm_pd_proxy", "--prefill", urls["prefill"],
           "--decode", urls["decode"], "--port", str(port)]
    url, pid = stack.enter_context(peer_server("vllm-pd-proxy", cmd, port, log_dir / "vllm-pd-proxy.log", 60))
    return {"url": url, "pids": [*pids, pid], "cmd": f"prefill, decode and proxy: see {log_dir}/vllm-*.log"}


def start_servers(stack: contextlib.ExitStack, args, bf16_dir: Path, log_dir: Path) -> dict[str, dict]:
    up: dict[str, dict] = {}
    if "vllm-pd" in args.servers:
        up["vllm-pd"] = vllm_pd(stack, args, bf16_dir, log_dir)
    if "vllm" in args.servers:
        port = free_port()
        cmd = vllm_command(args, bf16_dir, port, max_model_len=args.max_model_len)
        url, pid = stack.enter_context(peer_server("vllm", cmd, port, log_dir / "vllm.log", args.startup_timeout_s,
                                                   env=vllm_env(args, f"0-{(os.cpu_count() or 2) - 1}")))
        up["vllm"] = {"url": url, "pids": [pid], "cmd": " ".join(cmd)}
    for name, layout in PDSERVE.items():
        if name in args.servers:
            model = str(bf16_dir) if name.endswith("-bf16") else DEFAULT_MODEL
            targets = ("--ttft-slo-ms", str(args.ttft_slo_ms), "--itl-slo-ms", str(args.itl_slo_ms))
            flags = ("--model", model, *layout, *(targets if args.tell_targets else ()))
            c = stack.enter_context(local_cluster(*flags, log_path=str(log_dir / f"{name}.log"),
                                                  startup_timeout_s=args.startup_timeout_s))
            up[name] = {"url": c.url, "pids": [c.proc.pid], "cmd": "pdserve up " + " ".join(flags)}
    return up


def run_rows(up: dict[str, dict], args) -> dict[str, dict[float, list[dict]]]:
    """Every rate, run and server in turn, the other servers stopped meanwhile."""
    results: dict[str, dict[float, list[dict]]] = {name: {} for name in up}
    trees = {name: [p for pid in u["pids"] for p in process_tree(pid)] for name, u in up.items()}

    def others(name: str) -> list[int]:
        return [p for other, pids in trees.items() if other != name for p in pids]

    for name, u in up.items():
        with paused(others(name)):
            warm_up(u["url"], args)
    for rate in args.rates:
        for run in range(args.runs):
            for name, u in up.items():
                with paused(others(name)):
                    row = measure(u["url"], args, rate, run)
                results[name].setdefault(rate, []).append(row)
                print(f"{name} rate {rate} run {run}: {json.dumps(row)}", flush=True)
    return results


def table(results: dict[str, dict[float, list[dict]]], rates: list[float]) -> str:
    lines = ["| server | conv/s | attainment | TTFT p50 / p90 ms | TPOT p50 / p90 ms | cached | runs: attainment |",
             "|---|---:|---:|---|---|---:|---|"]
    for rate in rates:
        for name, by_rate in results.items():
            rows = by_rate[rate]
            med = {k: statistics.median(r[k] or 0 for r in rows)
                   for k in ("attainment", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "cached_share")}
            runs = ", ".join(f"{r['attainment']:.0%}" for r in rows)
            lines.append(f"| {name} | {rate:g} | {med['attainment']:.1%} | {med['ttft_p50_ms']:,.0f} / "
                         f"{med['ttft_p90_ms']:,.0f} | {med['tpot_p50_ms']:.1f} / {med['tpot_p90_ms']:.1f} | "
                         f"{med['cached_share']:.1%} | {runs} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=["vllm-pd", "pdserve-pd"])
    p.add_argument("--rates", default="0.5,1", type=lambda s: [float(r) for r in s.split(",")],
                   help="conversations started a second (Poisson)")
    p.add_argument("--runs", type=int, default=3, help="repeats per rate (medians are reported)")
    p.add_argument("--requests", type=int, default=16, help="conversations per rate and run")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--itl-slo-ms", type=float, default=100.0)
    p.add_argument("--tell-targets", action="store_true",
                   help="give pdserve the targets (--ttft-slo-ms, --itl-slo-ms; vLLM has no such setting)")
    p.add_argument("--trace", default=None, help="the Mooncake conversation trace (default: bench_goodput's slice)")
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", DEFAULT_VLLM_PYTHON))
    p.add_argument("--vllm-kv-gb", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE per vLLM server")
    p.add_argument("--max-num-seqs", type=int, default=128, help="vLLM's batch")
    p.add_argument("--vllm-pd-cores", choices=("split", "shared"), default="split",
                   help="vllm-pd's engines: one core each (split), or every core each (shared)")
    p.add_argument("--max-model-len", type=int, default=8192, help="vLLM's (SmolLM2's context)")
    p.add_argument("--bf16-dir", default=os.path.expanduser("~/.cache/pdserve/smollm2-135m-bf16"))
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    # What bench_goodput.measure reads: its conversation workload, random ids below SmolLM2's vocabulary.
    args.trace = args.trace or TRACE_SLICE
    args.workload, args.vocab, args.cache_capacity_tokens = "conversation", 49152, None
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    log_dir = Path(args.log_dir or f"/tmp/bench-vs-vllm-pd-{time.strftime('%Y%m%d-%H%M%S')}")
    log_dir.mkdir(parents=True, exist_ok=True)
    bf16_dir = bf16_checkpoint(Path(args.bf16_dir))
    print(f"load average at start {load_average()}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the finally blocks: stop the servers
    with contextlib.ExitStack() as stack:
        up = start_servers(stack, args, bf16_dir, log_dir)
        results = run_rows(up, args)
    print(f"\nconversation replay, {args.requests} conversations a run, targets TTFT {args.ttft_slo_ms:g} ms and "
          f"TPOT {args.itl_slo_ms:g} ms, medians of {args.runs}; load average at end {load_average()}; "
          f"pdserve {source_info().get('commit')}\n")
    print(table(results, args.rates))
    print("\n" + "\n".join(f"{n}: {u['cmd']}" for n, u in up.items()) + f"\nlogs: {log_dir}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(
            {"args": vars(args), "source": source_info(), "servers": up,
             "results": {n: {str(r): rows for r, rows in v.items()} for n, v in results.items()}},
            indent=1, default=str))


if __name__ == "__main__":
    main()
