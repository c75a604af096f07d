"""How a TP step's inputs reach a worker: shared memory against a gloo broadcast, in isolation.

Two processes; each iteration the driver sends a StepPlan down the worker's pipe and the step's
flat int64 arrays by one transport, the worker takes its copy, and a one-element all-reduce
stands for the step's first collective. The figure is the iteration time less a run that sends
no arrays (pipe + all-reduce only):

    .venv/bin/python -m benchmarks.engine.bench_tp_inputs
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch

from pdserve.executor.group import join_store, make_group, open_store
from pdserve.executor.kv_shared import create_shared_file, fd_path
from pdserve.executor.messages import StepPlan, read_message, write_message
from pdserve.executor.step_channel import StepChannel, payload_length

CAPACITY = 1 << 20
# (name, tokens, int32 shapes): a decode step of 64 sequences with 40-block tables, and a
# 2048-token prefill step of 8 prompts.
CASES = [("decode, 64 seqs", 64, [[64], [64, 40], [1], [0], [0, 1]]),
         ("prefill, 2048 tokens", 2048, [[0], [0, 1], [9], [8], [8, 40]]),
         ("none (baseline)", 0, [[0], [0, 1], [1], [0], [0, 1]])]
ITERS = 2000


def plan(tokens: int, shapes, in_shm: bool) -> StepPlan:
    return StepPlan(tokens, 0, shapes, [], [], False, in_shm)


def worker(port: int, fd: int) -> None:
    group = make_group(join_store("127.0.0.1", port, 2, 60), 1, 2, torch.device("cpu"), 60)
    channel = StepChannel(fd_path(fd), CAPACITY, group)
    one = torch.ones(1)
    while (msg := read_message(sys.stdin.fileno())) is not None:
        channel.receive(msg)
        group.all_reduce(one)


def driver() -> None:
    torch.set_num_threads(1)
    fd = create_shared_file(CAPACITY * 8, "bench")
    store = open_store(2, 60)
    proc = subprocess.Popen([sys.executable, "-m", __spec__.name, "--worker", str(store.port), str(fd)],
                            stdin=subprocess.PIPE, pass_fds=(fd,), env=dict(os.environ, OMP_NUM_THREADS="1"))
    group = make_group(store, 0, 2, torch.device("cpu"), 60)
    channel = StepChannel(fd_path(fd), CAPACITY, group)
    one = torch.ones(1)
    results = {}
    for name, tokens, shapes in CASES:
        for in_shm in (True, False):
            p = plan(tokens, shapes, in_shm)
            flat = torch.arange(payload_length(p), dtype=torch.int64)
            times = []
            for _ in range(ITERS):
                start = time.perf_counter()
                if in_shm:
                    channel.write(flat.numpy())
                write_message(proc.stdin.fileno(), p)
                if not in_shm:
                    channel.broadcast(flat)
                group.all_reduce(one)
                times.append(time.perf_counter() - start)
            results[(name, in_shm)] = (statistics.median(times) * 1e6, payload_length(p) * 8)
    proc.stdin.close()
    proc.wait()
    base = min(results[("none (baseline)", True)][0], results[("none (baseline)", False)][0])
    print("| step | bytes | shared memory (us) | broadcast (us) |\n|---|---:|---:|---:|")
    for name, _, _ in CASES[:-1]:
        shm, nbytes = results[(name, True)]
        bc, _ = results[(name, False)]
        print(f"| {name} | {nbytes} | {shm - base:.0f} | {bc - base:.0f} |")
    print(f"(baseline, pipe + all-reduce: {base:.0f} us; median of {ITERS})")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]))
    else:
        driver()
