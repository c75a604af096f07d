"""The typed handover on the wire, the NIXL handshake refusing a peer it must not READ from, and a
router keeping a node of another wire version out of its rotation.

The handshake runs over a real zmq socket: a stand-in prefill side channel answers the decode
side's NixlMetadataRequest; no NIXL agent is needed to see a mismatched peer refused."""
from __future__ import annotations

import threading

import msgspec
import pytest
import zmq

from pdserve.kvstore.nixl_transfer import NixlTransferError
from pdserve.node.pullers import fetch_peer_metadata
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.router.dispatch.nodes import Node, NodePool
from pdserve.wire.handover import (
    HANDSHAKE_VERSION,
    NixlHandover,
    NixlMetadata,
    NixlMetadataRequest,
    StoreHandover,
    handover_path,
    peer_mismatch,
)
from pdserve.wire.messages import WIRE_VERSION, DecodeRequest, Pong, PrefillRequest, PrefillResult, decode, encode
from pdserve.wire.transport import NodeSocket, free_port

NIXL = NixlHandover(48, "prefill-0", "tcp://127.0.0.1:1", [(4096, 8192, 0)] * 3, [1, 2, 3], 30.0, first_block=1)
STORE = StoreHandover(40, [b"k0", b"k1", b"k2"])


@pytest.mark.parametrize(("handover", "path"), [(NIXL, "nixl"), (STORE, "store"), (None, "none")])
def test_each_handover_travels_as_its_own_type(handover, path):
    got = decode(encode(PrefillResult("r", handover=handover)))
    assert got.handover == handover and type(got.handover) is type(handover)
    request = decode(encode(DecodeRequest("r", [1, 2], SamplingParams(), [3], handover)))
    assert request.pulls_kv() == (handover is not None)
    assert handover_path(handover) == path


def test_a_transport_the_wire_does_not_know_is_not_decoded():
    good = encode(PrefillRequest("r", [1], SamplingParams(), "nixl"))
    assert decode(good).transfer == "nixl"
    with pytest.raises(msgspec.ValidationError):
        decode(encode(PrefillRequest("r", [1], SamplingParams(), "carrier-pigeon")))


def test_digests_must_match_the_regions():
    with pytest.raises(ValueError):
        NixlHandover(16, "a", "", [(0, 8192, 0)] * 2, [1], 1.0)


def test_peer_checks():
    peer = NixlMetadata("prefill-0", b"md", kv_salt=b"layout", block_nbytes=8192)
    assert peer_mismatch(peer, b"layout", 8192) is None
    assert peer_mismatch(peer) is None  # nothing of ours to compare
    assert "version" in peer_mismatch(NixlMetadata("p", b"md", version=HANDSHAKE_VERSION + 1))
    assert "KV layout" in peer_mismatch(peer, b"another layout", 8192)
    assert "8192-byte blocks" in peer_mismatch(peer, b"layout", 4096)


@pytest.fixture
def side_channel():
    """A prefill node's side channel stand-in: answers each request with the reply it is given."""
    ctx = zmq.Context.instance()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sock = NodeSocket(ctx, endpoint)
    reply: list[NixlMetadata] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if sock.sock.poll(20) and (item := sock.recv()) is not None:
                identity, msg = item
                assert isinstance(msg, NixlMetadataRequest) and msg.version == HANDSHAKE_VERSION
                sock.send(identity, reply[0])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield ctx, endpoint, reply
    finally:
        stop.set()
        thread.join(5)
        sock.close()


def test_a_peer_of_another_handshake_version_is_refused(side_channel):
    ctx, endpoint, reply = side_channel
    reply.append(NixlMetadata("prefill-0", b"md", kv_salt=b"layout", block_nbytes=8192))
    assert fetch_peer_metadata(ctx, endpoint, b"layout", 8192).metadata == b"md"
    reply[0] = NixlMetadata("prefill-0", b"md", version=HANDSHAKE_VERSION + 1)
    with pytest.raises(NixlTransferError, match="handshake version"):
        fetch_peer_metadata(ctx, endpoint, b"layout", 8192)
    reply[0] = NixlMetadata("prefill-0", b"md", kv_salt=b"other", block_nbytes=8192)
    with pytest.raises(NixlTransferError, match="KV layout"):
        fetch_peer_metadata(ctx, endpoint, b"layout", 8192)


def test_a_node_of_another_wire_version_stays_out_of_the_rotation():
    node = Node("decode-0", "decode", "tcp://127.0.0.1:1", sock=None)
    NodePool._on_pong(node, Pong(1, "decode-0", "decode", version=WIRE_VERSION + 1))
    assert not node.healthy and node.refused
    NodePool._on_pong(node, decode(encode(Pong(2, "decode-0", "decode"))))  # upgraded
    assert node.healthy and not node.refused
