"""Discovery through the node registry, on real processes over real sockets.

`pdserve up` hosts a registry and every node registers in it. A decode node started by hand
afterwards, given only --registry, joins the router's rotation and serves (greedy output equal
to the offline engine's); SIGKILLed and started again at a new address, it rejoins without a
router restart. In-process: a node that stops heartbeating leaves the routers' pools, and a
registry restart keeps every router's nodes while the nodes register again.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import psutil
import pytest
import zmq
from cluster_util import assert_greedy_matches_offline, node_stats, running_cluster, wait_for

from pdserve import LLM
from pdserve.cluster.registration import NodeRegistration
from pdserve.cluster.registry import RegistryServer
from pdserve.cluster.registry_messages import EXPIRE_AFTER_S, NodeRecord, Register, encode
from pdserve.router.nodes import NodePool
from pdserve.router.registry_watcher import RegistryWatcher
from pdserve.transport import free_port

PROMPT = list(range(3, 60))


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny", num_kv_blocks=512)


@pytest.fixture(scope="module")
def cluster():
    # Decode nodes only (each request runs whole on one): the test is about finding nodes.
    with running_cluster("--kv-transfer", "nixl", "--prefill-nodes", "0", "--decode-nodes", "1",
                         "--decode-policy", "round_robin", "--num-kv-blocks", "512") as (url, proc):
        yield url, proc


def _router_flag(up_pid: int, flag: str) -> str:
    for child in psutil.Process(up_pid).children():
        cmd = child.cmdline()
        if "router" in cmd and flag in cmd:
            return cmd[cmd.index(flag) + 1]
    raise AssertionError(f"no router with {flag} under pid {up_pid}")


def _start_decode(registry: str, node_id: str, log_path: str) -> tuple[subprocess.Popen, str]:
    addr = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "pdserve", "--log-level", "INFO", "decode",
           "--model", "builtin:tiny", "--node-id", node_id,
           "--bind", addr, "--registry", registry, "--nixl", "--num-kv-blocks", "512"]
    with open(log_path, "a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc, addr


def _serves(url: str, llm, node_id: str) -> None:
    """Requests until `node_id` has served some (round robin over the decode nodes), each one's
    greedy output equal to the offline engine's."""
    before = node_stats(url)[node_id].get("requests_total", 0)
    for i in range(6):
        assert_greedy_matches_offline(url, llm, PROMPT[i:], 12)
    assert node_stats(url)[node_id]["requests_total"] > before


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def test_node_started_later_joins_then_rejoins_from_a_new_address(cluster, llm, tmp_path):
    url, up = cluster
    registry = _router_flag(up.pid, "--registry")
    router_pid = next(c.pid for c in psutil.Process(up.pid).children() if "router" in c.cmdline())
    late, addr = _start_decode(registry, "decode-late", str(tmp_path / "late.log"))
    try:
        node = wait_for(lambda: node_stats(url).get("decode-late", {}).get("healthy")
                        and node_stats(url)["decode-late"], timeout_s=120)
        assert node["address"] == addr and node["role"] == "decode"
        _serves(url, llm, "decode-late")

        late.send_signal(signal.SIGKILL)  # no Deregister: the router sees the disconnect, the registry the silence
        late.wait(timeout=30)
        late, new_addr = _start_decode(registry, "decode-late", str(tmp_path / "late.log"))
        assert new_addr != addr
        wait_for(lambda: (n := node_stats(url).get("decode-late", {})).get("address") == new_addr
                 and n.get("healthy"), timeout_s=120)
        _serves(url, llm, "decode-late")
        assert router_pid in {c.pid for c in psutil.Process(up.pid).children()}, "the router was restarted"
        # A clean exit deregisters: the node leaves the pool without waiting for the expiry.
        late.send_signal(signal.SIGTERM)
        late.wait(timeout=30)
        wait_for(lambda: "decode-late" not in node_stats(url), timeout_s=EXPIRE_AFTER_S - 1)
    finally:
        _stop(late)


async def _watch(registry: str, seconds: float, probe) -> list:
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
        await asyncio.gather(watcher, return_exceptions=True)
        await pool.stop()
    return samples


def test_a_silent_node_expires_from_the_pool():
    server = RegistryServer("tcp://127.0.0.1:0").start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(server.address)
        sock.send(encode(Register(NodeRecord("decode-x", "decode", "tcp://127.0.0.1:1", incarnation=1))))
        samples = asyncio.run(_watch(server.address, EXPIRE_AFTER_S + 2.5,
                                     lambda pool: [n.node_id for n in pool.nodes]))
    finally:
        sock.close()
        server.stop()
    assert ["decode-x"] in samples, "the registered node never reached the pool"
    assert samples[-1] == [], "a node with no heartbeat stayed in the pool"


def test_a_registry_restart_keeps_the_routers_nodes():
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    server = RegistryServer(address).start()
    reg = NodeRegistration(address, NodeRecord("prefill-x", "prefill", "tcp://127.0.0.1:1", incarnation=5)).start()

    async def scenario() -> list:
        nonlocal server
        task = asyncio.create_task(_watch(address, 6.0, lambda pool: [n.node_id for n in pool.nodes]))
        await asyncio.sleep(1.0)
        server.stop()  # the registry's process dies with its memberships...
        await asyncio.sleep(0.5)
        server = RegistryServer(address).start()  # ...and a new one starts empty on the same address
        return await task

    try:
        samples = asyncio.run(scenario())
        assert server.members() and server.members()[0].node_id == "prefill-x"
    finally:
        reg.close()
        server.stop()
    assert samples[8:] and all(s == ["prefill-x"] for s in samples[8:]), samples
    assert reg.registrations >= 2, "the node did not register again with the new registry"
