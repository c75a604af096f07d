"""Helpers for the node registry tests (zmq and Redis forms): decode nodes started by hand with
--registry, a check that a node serves exact output, and a router's pool and watcher in-process."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

from pdserve.router.dispatch.nodes import NodePool
from pdserve.router.scaling.registry_watcher import RegistryWatcher
from pdserve.testing.up_cluster import assert_greedy_matches_offline, node_stats, wait_for
from pdserve.wire.transport import free_port

PROMPT = list(range(3, 60))


def start_decode(registry: str, node_id: str, log_path: str) -> tuple[subprocess.Popen, str]:
    """`pdserve decode` registering at `registry`; returns the process and its control address."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "pdserve", "--log-level", "INFO", "decode",
           "--model", "builtin:tiny", "--node-id", node_id,
           "--bind", addr, "--registry", registry, "--nixl", "--num-kv-blocks", "512"]
    with open(log_path, "a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc, addr


def serves(url: str, llm, node_id: str) -> None:
    """Requests until `node_id` has served some (round robin over the decode nodes), each one's
    greedy output equal to the offline engine's."""
    before = node_stats(url)[node_id].get("requests_total", 0)
    for i in range(6):
        assert_greedy_matches_offline(url, llm, PROMPT[i:], 12)
    # The count rides on the node's pongs (every 0.2 s): wait for one sent after its requests.
    wait_for(lambda: node_stats(url)[node_id]["requests_total"] > before, timeout_s=10)


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def terminate_process(proc: subprocess.Popen) -> None:
    """A clean stop (SIGTERM: a node deregisters on its way out), SIGKILL if it takes 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    finally:
        stop_process(proc)


async def watch_pool(registry: str, seconds: float, probe) -> list:
    """Run a router's pool and watcher for `seconds`, sampling probe(pool) every 0.1 s."""
    pool = NodePool([], [], lambda node, msg: None, lambda node: None)
    await pool.start()
    watcher = asyncio.create_task(RegistryWatcher(registry, pool).run())
    samples = []
    try:
        for _ in range(int(seconds / 0.1)):
            await asyncio.sleep(0.1)
            samples.append(probe(pool))
    finally:
        watcher.cancel()
        await _bounded(asyncio.gather(watcher, return_exceptions=True), "the watcher's cancel")
        await _bounded(pool.stop(), "the pool's stop")
    return samples


async def _bounded(step, what: str, timeout_s: float = 20.0) -> None:
    """Await a clean-up step; if it hangs, fail with every task's stack (a hang's only trace)."""
    try:
        await asyncio.wait_for(step, timeout_s)
    except TimeoutError:
        for task in asyncio.all_tasks():
            task.print_stack(file=sys.stderr)
        raise AssertionError(f"{what} did not finish in {timeout_s:.0f} s; task stacks above") from None
