"""Discovery through the node registry, on real processes over real sockets.

`pdserve up` hosts a registry and every node registers in it. A decode node started by hand
afterwards, given only --registry, joins the router's rotation and serves (greedy output equal
to the offline engine's); SIGKILLed and started again at a new address, it rejoins without a
router restart. In-process: a node that stops heartbeating leaves the routers' pools, and a
registry restart keeps every router's nodes while the nodes register again.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import signal
import time

import msgspec
import psutil
import pytest
import zmq
from registry_util import serves, start_decode, stop_process, watch_pool

from pdserve import LLM
from pdserve.cluster import registry as registry_module
from pdserve.cluster.registration import NodeRegistration
from pdserve.cluster.registry import RegistryServer
from pdserve.cluster.registry_messages import EXPIRE_AFTER_S, NodeRecord, Register, encode
from pdserve.router.dispatch.nodes import NodePool
from pdserve.router.scaling.registry_watcher import RegistryWatcher
from pdserve.testing.up_cluster import node_stats, running_cluster, wait_for
from pdserve.wire.compat import KVCompat
from pdserve.wire.transport import free_port


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


def test_node_started_later_joins_then_rejoins_from_a_new_address(cluster, llm, tmp_path):
    url, up = cluster
    registry = _router_flag(up.pid, "--registry")
    router_pid = next(c.pid for c in psutil.Process(up.pid).children() if "router" in c.cmdline())
    late, addr = start_decode(registry, "decode-late", str(tmp_path / "late.log"))
    try:
        node = wait_for(lambda: node_stats(url).get("decode-late", {}).get("healthy")
                        and node_stats(url)["decode-late"], timeout_s=120)
        assert node["address"] == addr and node["role"] == "decode"
        serves(url, llm, "decode-late")

        late.send_signal(signal.SIGKILL)  # no Deregister: the router sees the disconnect, the registry the silence
        late.wait(timeout=30)
        late, new_addr = start_decode(registry, "decode-late", str(tmp_path / "late.log"))
        assert new_addr != addr
        wait_for(lambda: (n := node_stats(url).get("decode-late", {})).get("address") == new_addr
                 and n.get("healthy"), timeout_s=120)
        serves(url, llm, "decode-late")
        assert router_pid in {c.pid for c in psutil.Process(up.pid).children()}, "the router was restarted"
        # A clean exit deregisters: the node leaves the pool without waiting for the expiry.
        late.send_signal(signal.SIGTERM)
        late.wait(timeout=30)
        wait_for(lambda: "decode-late" not in node_stats(url), timeout_s=EXPIRE_AFTER_S - 1)
    finally:
        stop_process(late)


def _silent_node_samples() -> list:
    server = RegistryServer("tcp://127.0.0.1:0").start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(server.address)
        sock.send(encode(Register(NodeRecord("decode-x", "decode", "tcp://127.0.0.1:1", incarnation=1))))
        return asyncio.run(watch_pool(server.address, EXPIRE_AFTER_S + 2.5,
                                      lambda pool: [n.node_id for n in pool.nodes]))
    finally:
        sock.close()
        server.stop()


def _kv_differs_samples() -> list:
    agreed = KVCompat("a" * 32, "float32", "float32", 16, 2, 4, 2, 32)
    server = RegistryServer("tcp://127.0.0.1:0").start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    records = [NodeRecord("decode-x", "decode", "tcp://127.0.0.1:1", incarnation=1, compat=agreed),
               NodeRecord("prefill-y", "prefill", "tcp://127.0.0.1:2", incarnation=1,
                          compat=msgspec.structs.replace(agreed, block_size=32))]
    try:
        sock.connect(server.address)
        for record in records:
            sock.send(encode(Register(record)))
        return asyncio.run(watch_pool(server.address, 1.5, lambda pool: {
            n.node_id: (n.refused, n.refusal) for n in pool.nodes}))
    finally:
        sock.close()
        server.stop()


def _registry_restart() -> tuple[list, list[str], int]:
    """The pool's samples, the new registry's members and the node's registrations."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    server = RegistryServer(address).start()
    reg = NodeRegistration(address, NodeRecord("prefill-x", "prefill", "tcp://127.0.0.1:1", incarnation=5)).start()

    async def scenario() -> list:
        nonlocal server
        task = asyncio.create_task(watch_pool(address, 6.0, lambda pool: [n.node_id for n in pool.nodes]))
        await asyncio.sleep(1.0)
        server.stop()  # the registry's process dies with its memberships...
        await asyncio.sleep(0.5)
        server = RegistryServer(address).start()  # ...and a new one starts empty on the same address
        return await task

    try:
        samples = asyncio.run(scenario())
        return samples, [m.node_id for m in server.members()], reg.registrations
    finally:
        reg.close()
        server.stop()


def _never_registers_samples() -> list:
    address = f"tcp://127.0.0.1:{free_port()}"
    server = RegistryServer(address).start()
    live = NodeRegistration(address, NodeRecord("prefill-x", "prefill", "tcp://127.0.0.1:1", incarnation=5)).start()
    dead = NodeRegistration(address, NodeRecord("decode-y", "decode", "tcp://127.0.0.1:2", incarnation=6)).start()

    async def scenario() -> list:
        nonlocal server
        task = asyncio.create_task(watch_pool(address, EXPIRE_AFTER_S + 6.0,
                                              lambda pool: sorted(n.node_id for n in pool.nodes)))
        await asyncio.sleep(1.5)
        server.stop()
        dead.close()  # dies while the registry is down: it never registers with the new one
        await asyncio.sleep(0.5)
        server = RegistryServer(address).start()
        return await task

    try:
        return asyncio.run(scenario())
    finally:
        live.close()
        server.stop()


# test name -> its in-process scenario (a registry, registrations and a router's pool and watcher)
SCENARIOS = {"test_a_silent_node_expires_from_the_pool": _silent_node_samples,
             "test_a_node_whose_kv_differs_is_refused_at_registration": _kv_differs_samples,
             "test_a_registry_restart_keeps_the_routers_nodes": _registry_restart,
             "test_a_node_that_never_registers_with_a_restarted_registry_leaves_the_pool": _never_registers_samples}


@pytest.fixture(scope="module")
def scenarios(request):
    """The selected tests' scenarios, started together at the first of them: each spends its
    seconds in fixed windows (heartbeats, expiries, a registry down) on threads that barely use
    the CPU, so side by side they take the longest one's time, not their sum (each has its own
    registry on its own port). Each test asserts on its own scenario's result."""
    selected = {item.name for item in request.session.items}
    with cf.ThreadPoolExecutor(len(SCENARIOS)) as pool:
        yield {name: pool.submit(run) for name, run in SCENARIOS.items() if name in selected}


def test_a_silent_node_expires_from_the_pool(scenarios):
    samples = scenarios["test_a_silent_node_expires_from_the_pool"].result()
    assert ["decode-x"] in samples, "the registered node never reached the pool"
    assert samples[-1] == [], "a node with no heartbeat stayed in the pool"


def test_a_node_whose_kv_differs_is_refused_at_registration(scenarios):
    """The records carry each node's KVCompat: a router refuses the odd node as it adds it, before
    any pong (these addresses answer none), and routes to the one that agrees."""
    last = scenarios["test_a_node_whose_kv_differs_is_refused_at_registration"].result()[-1]
    assert set(last) == {"decode-x", "prefill-y"}
    assert last["decode-x"] == (False, "")
    assert last["prefill-y"][0] and "block size: 32" in last["prefill-y"][1]


def test_a_registry_restart_keeps_the_routers_nodes(scenarios):
    samples, members, registrations = scenarios["test_a_registry_restart_keeps_the_routers_nodes"].result()
    assert members and members[0] == "prefill-x"
    assert samples[8:] and all(s == ["prefill-x"] for s in samples[8:]), samples
    assert registrations >= 2, "the node did not register again with the new registry"


def test_a_node_that_never_registers_with_a_restarted_registry_leaves_the_pool(scenarios):
    """The new registry re-sends an unchanged membership once the grace after its restart ends:
    the node it never heard from must still be removed then, not kept for good."""
    samples = scenarios["test_a_node_that_never_registers_with_a_restarted_registry_leaves_the_pool"].result()
    assert ["decode-y", "prefill-x"] in samples[:15], samples
    assert samples[-1] == ["prefill-x"], "a node the restarted registry never heard from stayed in the pool"


def test_a_record_that_expires_while_its_node_answers_keeps_the_node(scenarios, tmp_path, monkeypatch):
    """A loaded host can starve a node's heartbeat thread past the expiry while the node still
    answers the router's pings (a Ray run under load once lost a stream so: the registry dropped the
    last decode node's record and the router removed the node). Here the registry expires records
    after 0.3 s while the node heartbeats every second, so its record comes and goes: the pool
    keeps the node in rotation throughout, and drops it once the node is killed."""
    cf.wait(scenarios.values())  # the expiry below is the module's: theirs must have ended
    monkeypatch.setattr(registry_module, "EXPIRE_AFTER_S", 0.3)
    server = RegistryServer(f"tcp://127.0.0.1:{free_port()}").start()
    node, _ = start_decode(server.address, "decode-x", str(tmp_path / "x.log"))

    def in_rotation(pool) -> bool:
        return (n := pool.get("decode-x")) is not None and n.healthy

    async def scenario() -> tuple[list[bool], float]:
        pool = NodePool([], [], lambda node, msg: None, lambda node: None)
        await pool.start()
        watcher = RegistryWatcher(server.address, pool)
        task = asyncio.create_task(watcher.run())
        try:
            await _until(lambda: in_rotation(pool), 120)
            samples = []
            for _ in range(50):  # 5 s: the record expires about every second
                await asyncio.sleep(0.1)
                samples.append(in_rotation(pool))
            node.kill()
            return samples, await _until(lambda: pool.get("decode-x") is None, 10)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await pool.stop()

    try:
        expired_before = server.version
        samples, gone_after = asyncio.run(scenario())
        assert server.version - expired_before >= 4, "the record never expired: the test tests nothing"
    finally:
        stop_process(node)
        server.stop()
    assert all(samples), f"the node left the rotation while it answered pings: {samples}"
    print(f"killed: out of the pool after {gone_after:.2f} s")


async def _until(predicate, timeout_s: float) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "timed out"
        await asyncio.sleep(0.05)
    return time.monotonic() - start
