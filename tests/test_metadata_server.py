"""A prefill node's NIXL side channel on a thread of its own (node.metadata_server): the handshake a
decode node makes (pullers.fetch_peer_metadata, real ZMQ sockets on loopback) is answered while
the thread that made the server is busy elsewhere, as the node's loop is in a WRITE into that
same decode node; a peer whose layout differs is still refused, other messages are ignored, and
close() gives the port back."""
from __future__ import annotations

import threading
import time

import pytest
import zmq

from pdserve.kvstore.nixl_transfer import NixlTransferError
from pdserve.node.metadata_server import MetadataServer
from pdserve.node.pullers import fetch_peer_metadata
from pdserve.wire.handover import NixlMetadata
from pdserve.wire.messages import Drain, encode
from pdserve.wire.transport import NodeSocket, free_port

METADATA = NixlMetadata("prefill-0.1.abc", b"agent-md", kv_salt=b"salt", block_nbytes=4096)


@pytest.fixture
def served():
    ctx = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port()}"
    server = MetadataServer(NodeSocket(ctx, address), METADATA)
    yield ctx, address, server
    server.close()
    ctx.term()


def test_the_handshake_is_answered_while_its_owner_is_busy(served):
    ctx, address, _ = served
    got: list = []
    asker = threading.Thread(target=lambda: got.append(fetch_peer_metadata(ctx, address, b"salt", 4096)))
    t0 = time.monotonic()
    asker.start()
    # This thread made the server and now neither polls nor returns: as a node's loop waiting in a
    # WRITE. The answer must not wait for it (the loop used to answer, 0.5-3 s later).
    time.sleep(0.6)
    asker.join(timeout=5)
    assert got == [METADATA]
    assert time.monotonic() - t0 < 1.0


def test_a_peer_of_another_layout_is_refused_and_other_messages_ignored(served):
    ctx, address, _ = served
    with pytest.raises(NixlTransferError, match="byte blocks"):
        fetch_peer_metadata(ctx, address, b"salt", 8192)
    stray = ctx.socket(zmq.DEALER)
    stray.setsockopt(zmq.LINGER, 0)
    stray.connect(address)
    stray.send(encode(Drain("decode")))
    assert not stray.poll(300)  # no answer to what is not a handshake
    stray.close(0)
    assert fetch_peer_metadata(ctx, address, b"salt", 4096) == METADATA  # and it still serves


def test_close_stops_the_thread_and_gives_the_port_back():
    ctx = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port()}"
    server = MetadataServer(NodeSocket(ctx, address), METADATA)
    server.close()
    assert not server._thread.is_alive()
    # the address binds again (ZMQ's I/O thread releases it after close returns: a moment on a loaded machine)
    deadline = time.monotonic() + 10
    while True:
        try:
            again = NodeSocket(ctx, address)
            break
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    again.close()
    ctx.term()
