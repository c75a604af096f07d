"""What a test cluster's start costs: wall seconds to healthy, and the CPU seconds each of its
processes spent getting there (docs/testing.md, "Where the time goes").

CPU seconds are the figure to compare between two versions on a shared machine: wall time moves
with the load and with processes stopped by someone's benchmark, a process's CPU time barely does.

    .venv/bin/python scripts/cluster-start-cpu.py [--runs N] [pdserve up flags ...]

With no flags it starts what conftest's plain_cluster starts (builtin:tiny, 1 prefill and 1
decode node, KV over NIXL, running_cluster's test defaults). Run it under `nice -n 19` on a
shared machine.
"""
from __future__ import annotations

import argparse
import statistics
import time

import psutil

from pdserve.testing.up_cluster import running_cluster

PLAIN = ("--prefill-nodes", "1", "--decode-nodes", "1", "--kv-transfer", "nixl")
KINDS = ("prefill", "decode", "encode", "router", "redis-server")


def cpu_by_process(up_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of `pdserve up` and each process it started, by kind."""
    up = psutil.Process(up_pid)
    seconds = {"up": _cpu(up)}
    for child in up.children():
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:
            continue
        kind = next((k for k in KINDS if f" {k} " in f" {command} " or k in command.split(" ", 1)[0]), "other")
        seconds[kind] = seconds.get(kind, 0.0) + _cpu(child)
    return seconds


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args, flags = parser.parse_known_args()
    totals = []
    for run in range(args.runs):
        started = time.monotonic()
        with running_cluster(*(flags or PLAIN)) as (_, proc):
            wall = time.monotonic() - started
            seconds = cpu_by_process(proc.pid)
        totals.append(sum(seconds.values()))
        parts = ", ".join(f"{kind} {s:.2f}" for kind, s in sorted(seconds.items()))
        print(f"run {run + 1}: healthy after {wall:.1f} s wall; CPU {totals[-1]:.2f} s ({parts})", flush=True)
    print(f"CPU seconds to healthy: median {statistics.median(totals):.2f}, min {min(totals):.2f}")


if __name__ == "__main__":
    main()
