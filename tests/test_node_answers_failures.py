"""A request whose message raises inside a node is answered with the error, never left waiting.

A real prefill node (engine, zmq ROUTER socket) serves on loopback in a thread and a DEALER
"router" sends it prefills. The soak once found a prefill node's first regex request failing
inside its admission (an import race, fixed in structured_output): the node logged the error
and answered nothing, and the client's stream stayed silent for 150 s, until the router's
prefill timeout. Here a fault injected after the request's blocks are allocated stands for any
such bug: the node answers a PrefillResult with the error (the router then tries another
prefill node), frees the request's blocks, and serves the next request as before.
"""
from __future__ import annotations

import pytest
from node_thread import serving_in_thread
from test_router_gone import FakeRouter

from pdserve.assembly.build import build_engine
from pdserve.engine.config import EngineConfig
from pdserve.node.prefill import PrefillNode
from pdserve.testing.up_cluster import wait_for
from pdserve.wire.transport import free_port


@pytest.fixture
def prefill_node():
    engine = build_engine(EngineConfig(model="builtin:tiny", num_kv_blocks=32))
    port, side = free_port(), free_port()
    node = PrefillNode(engine, f"tcp://127.0.0.1:{port}", "prefill-0", nixl_side_channel=f"tcp://127.0.0.1:{side}")
    with serving_in_thread(node):
        yield node, f"tcp://127.0.0.1:{port}"


def test_a_prefill_that_raises_is_answered_and_frees_its_blocks(prefill_node):
    node, endpoint = prefill_node
    admit = node.ttft_clocks.admit
    failures = []

    def fails_once(req):  # runs after engine.add_request allocated the request's blocks
        if not failures:
            failures.append(req.request_id)
            raise RuntimeError("injected fault")
        return admit(req)

    node.ttft_clocks.admit = fails_once
    router = FakeRouter(endpoint)
    try:
        failed = router.prefill("bad-0", list(range(5, 45)))
        assert failures == ["bad-0"]
        assert failed.first is None and "prefill-0" in failed.error and "injected fault" in failed.error
        wait_for(lambda: "bad-0" not in node.engine.scheduler.requests and node.engine.pool.num_used == 0,
                 timeout_s=5)
        assert "bad-0" not in node.pending and "bad-0" not in node.origin
        ok = router.prefill("good-0", list(range(5, 45)))
        assert ok.error is None and ok.first is not None and ok.handover is not None
    finally:
        router.close()
