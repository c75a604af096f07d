"""zmq sockets carrying pdserve.wire.messages: a ROUTER on each node, DEALERs on the router."""
from __future__ import annotations

import logging
import os
import random
import socket

import msgspec
import zmq

from pdserve.wire import port_ledger
from pdserve.wire.curve_keys import PEER_DOMAIN, make_server
from pdserve.wire.messages import Message, decode, encode

log = logging.getLogger(__name__)


PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
# "LO-HI" (HI exclusive): the ports free_port draws from, inherited by the processes a launcher
# starts. Runs side by side on one machine (the test suite's workers) each take their own slice:
# a port drawn by one is bound seconds later, after its node's imports, and another run drawing
# in the meantime would find it free.
PORT_RANGE_ENV = "PDSERVE_PORT_RANGE"
_ports = random.Random()  # seeded from os.urandom, whatever a caller seeds the global one with
_handed_out: set[tuple[str, int]] = set()


def _ephemeral_floor() -> int:
    try:
        with open(PORT_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def port_range() -> tuple[int, int]:
    """[lo, hi) where free_port draws: 10000 up to the kernel's ephemeral range, narrowed by
    $PDSERVE_PORT_RANGE where set."""
    lo, hi = 10000, _ephemeral_floor()
    if spec := os.environ.get(PORT_RANGE_ENV):
        first, last = (int(part) for part in spec.split("-", 1))
        lo, hi = max(lo, first), min(hi, last)
    return lo, hi


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on host now, for a server that binds it later. Drawn below the kernel's
    ephemeral range: a port from bind(host, 0) is an ephemeral one, which any outgoing connection
    may take as its source port before the server binds it (seen in CI: a node that imported torch
    for seconds, then failed with 'Address already in use'). Never the same port twice a process,
    nor one another process of this user drew in the last ten minutes (pdserve.wire.port_ledger)."""
    lo, hi = port_range()
    for _ in range(64 if hi - lo > 1024 else 0):
        port = _ports.randrange(lo, hi)
        if (host, port) in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add((host, port))
        if port_ledger.claim(host, port):
            return port
    with socket.socket() as s:  # a narrow range below the ephemeral ports: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


class NodeSocket:
    """A node's ROUTER socket: many peers, each message tagged with the sender's identity. On a
    CurveContext it is a CURVE server admitting only the keys of `zap_domain`."""

    def __init__(self, ctx: zmq.Context, bind: str, zap_domain: str = PEER_DOMAIN):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished peer's messages are dropped
        make_server(self.sock, ctx, zap_domain)
        self.sock.bind(bind)

    def recv(self) -> tuple[bytes, Message] | None:
        """One message if any is waiting; malformed frames are logged and skipped."""
        try:
            identity, payload = self.sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        except ValueError:
            log.warning("dropped a message with an unexpected frame count")
            return None
        try:
            return identity, decode(payload)
        except msgspec.DecodeError as exc:
            log.warning("dropped an undecodable message: %s", exc)
            return None

    def send(self, identity: bytes, msg: Message) -> None:
        try:
            self.sock.send_multipart([identity, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a full or vanished peer must not stop the node
            log.warning("send to %r failed: %s", identity, exc)

    def close(self) -> None:
        self.sock.close(0)
