"""A prefill node frees a silent router's NIXL handovers at once, not when their leases end.

A real prefill node (engine, NIXL agent, zmq ROUTER socket) serves on loopback in a thread; two
DEALER "routers" talk to it over real sockets. Each gets a NIXL handover whose blocks stay pinned
for a 60 s lease. The router that keeps pinging keeps its blocks; the one that goes silent has
died, nobody will pull its blocks, and the node frees them within a few seconds.
"""
from __future__ import annotations

import time

import pytest
import zmq
from node_thread import serving_in_thread

from pdserve.assembly.build import build_engine
from pdserve.cluster.router_liveness import RouterLiveness
from pdserve.engine.config import EngineConfig
from pdserve.node.prefill import PrefillNode
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.testing.up_cluster import wait_for
from pdserve.wire.handover import NixlHandover
from pdserve.wire.messages import Ping, PrefillRequest, PrefillResult, decode, encode
from pdserve.wire.transport import free_port

GONE_AFTER_S = 1.0
LEASE_S = 60.0


@pytest.fixture
def prefill_node():
    engine = build_engine(EngineConfig(model="builtin:tiny", num_kv_blocks=32))
    port, side = free_port(), free_port()
    node = PrefillNode(engine, f"tcp://127.0.0.1:{port}", "prefill-0",
                       nixl_side_channel=f"tcp://127.0.0.1:{side}", lease_s=LEASE_S)
    node.routers_seen = RouterLiveness(GONE_AFTER_S)
    with serving_in_thread(node):
        yield node, f"tcp://127.0.0.1:{port}"


class FakeRouter:
    """The router's side of the wire: a DEALER that pings and asks for prefills."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.seq = 0

    def ping(self) -> None:
        self.seq += 1
        self.sock.send(encode(Ping(self.seq)))

    def prefill(self, rid: str, prompt: list[int]) -> PrefillResult:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        self.sock.send(encode(PrefillRequest(rid, prompt, params, "nixl")))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self.ping()
            if self.sock.poll(200):
                msg = decode(self.sock.recv())
                if isinstance(msg, PrefillResult) and msg.request_id == rid:
                    return msg
        raise AssertionError(f"no PrefillResult for {rid}")

    def drain(self) -> None:
        while self.sock.poll(0):
            self.sock.recv()

    def close(self) -> None:
        self.sock.close()


def test_silent_routers_leases_are_freed_the_live_routers_are_kept(prefill_node):
    node, endpoint = prefill_node
    live, dying = FakeRouter(endpoint), FakeRouter(endpoint)
    try:
        _check_silent_router_is_dropped(node, live, dying)
    finally:
        live.close()
        dying.close()


def _check_silent_router_is_dropped(node, live: FakeRouter, dying: FakeRouter) -> None:
    prompt = list(range(5, 45))  # 40 tokens: three blocks
    for router, rid in ((live, "live-0"), (dying, "dying-0")):
        result = router.prefill(rid, prompt)
        assert result.error is None and isinstance(result.handover, NixlHandover)
    assert set(node.nixl.leases) == {"live-0", "dying-0"}
    held_each = len(node.engine.scheduler.held["live-0"].block_ids)
    # `dying` stops pinging; `live` goes on. Well inside the 60 s lease, the silent router's
    # blocks return to the pool and the live router's stay pinned for its decode node's pull.
    deadline = time.monotonic() + 10
    while "dying-0" in node.nixl.leases and time.monotonic() < deadline:
        live.ping()
        live.drain()
        time.sleep(0.2)
    assert "dying-0" not in node.nixl.leases, "a dead router's lease outlived it"
    assert set(node.nixl.leases) == {"live-0"}
    wait_for(lambda: "dying-0" not in node.engine.scheduler.held and "dying-0" not in node.origin, timeout_s=5)
    assert node.engine.pool.num_used == held_each
