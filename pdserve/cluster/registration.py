"""A node's side of the registry: register, heartbeat, re-register, deregister.

The zmq registry's form is here; the Redis form (cluster/registry_redis.py) is the same class
with another _run, and cluster/registry_client.py picks one by the URL. Either way a thread of
its own, so the node's engine loop never waits on the registry. The node's record says how routers reach it: its control socket's endpoint with the
bind host replaced by --advertise-host (a node bound to 0.0.0.0 must name an address others can
dial), its NIXL side channel, and its block-key salt. A restarted node process registers a new
incarnation (its start time), so a registry that still holds the old record replaces it.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

import msgspec
import zmq

from pdserve.cluster.registry_messages import (
    HEARTBEAT_S,
    AdminReply,
    Deregister,
    Heartbeat,
    NodeRecord,
    Register,
    RegistryAck,
    ScaleRequest,
    SwitchRequest,
    decode,
    encode,
    is_redis_url,
)
from pdserve.kvstore.redact import redact_url

log = logging.getLogger(__name__)
WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]")


def advertised_endpoint(bound: str, advertise_host: str | None) -> str:
    """The endpoint others dial for a socket bound at `bound` (a real endpoint, port included)."""
    scheme, rest = bound.split("://", 1)
    host, port = rest.rsplit(":", 1)
    if advertise_host:
        host = advertise_host
    elif host in WILDCARD_HOSTS:
        # The host name resolves to the container in compose networks; elsewhere say what to set.
        host = socket.gethostname()
        log.warning("bound to %s with no --advertise-host: registering as %s (set --advertise-host to the "
                    "address other machines reach this node at)", bound, host)
    return f"{scheme}://{host}:{port}"


class NodeRegistration:
    """Keeps one node's record in the registry at `registry_url` until close()."""

    def __init__(self, registry_url: str, record: NodeRecord):
        self.registry_url = registry_url
        self._record = record
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._stop = threading.Event()
        self.registrations = 0  # how many Register messages were sent (tests read it)
        self._thread = threading.Thread(target=self._run, name="registration", daemon=True)

    @property
    def record(self) -> NodeRecord:
        with self._lock:
            return self._record

    def start(self) -> NodeRegistration:
        self._thread.start()
        log.info("registering %s %s at %s with %s", self._record.role, self._record.node_id,
                 self._record.control_addr, redact_url(self.registry_url))
        return self

    def update(self, **changes) -> NodeRecord:
        """Change the record (state="draining", role="decode", ...) and register it at once."""
        with self._lock:
            self._record = msgspec.structs.replace(self._record, **changes)
            record = self._record
        self._changed.set()
        return record

    def close(self) -> None:
        """Deregister (a clean exit leaves the rotation at once, not after the expiry)."""
        self._stop.set()
        self._changed.set()
        self._thread.join(timeout=3)

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 500)  # long enough for the Deregister to leave
        sock.setsockopt(zmq.SNDHWM, 16)  # while the registry is down, heartbeats need not pile up
        sock.connect(self.registry_url)
        try:
            self._send(sock, Register(self.record))
            next_beat = time.monotonic() + HEARTBEAT_S
            while not self._stop.is_set():
                if self._changed.wait(timeout=max(0.0, min(next_beat - time.monotonic(), 0.1))):
                    self._changed.clear()
                    if not self._stop.is_set():
                        self._send(sock, Register(self.record))
                self._read_acks(sock)
                if time.monotonic() >= next_beat:
                    record = self.record
                    self._send(sock, Heartbeat(record.node_id, record.incarnation))
                    next_beat = time.monotonic() + HEARTBEAT_S
            record = self.record
            self._send(sock, Deregister(record.node_id, record.incarnation))
        finally:
            sock.close()

    def _read_acks(self, sock: zmq.Socket) -> None:
        while sock.poll(0):
            try:
                msg = decode(sock.recv())
            except msgspec.DecodeError as exc:
                log.warning("undecodable message from the registry: %s", exc)
                continue
            if isinstance(msg, RegistryAck) and not msg.known:
                log.info("the registry does not know %s (it restarted, or the record expired): "
                         "registering again", self._record.node_id)
                self._send(sock, Register(self.record))

    def _send(self, sock: zmq.Socket, msg) -> None:
        if isinstance(msg, Register):
            self.registrations += 1
        try:
            sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # the registry is unreachable and the queue full: the next beat retries
            pass


def admin_request(registry_url: str, msg: ScaleRequest | SwitchRequest, timeout_s: float = 60.0) -> AdminReply:
    """Send an admin request to the registry's owner and wait for its answer."""
    if is_redis_url(registry_url):
        return AdminReply(False, "a Redis registry has no owner to take admin requests")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(registry_url)
        sock.send(encode(msg))
        if not sock.poll(int(timeout_s * 1000)):
            return AdminReply(False, f"the registry at {registry_url} did not answer in {timeout_s:.0f} s")
        reply = decode(sock.recv())
        return reply if isinstance(reply, AdminReply) else AdminReply(False, f"unexpected {type(reply).__name__}")
    finally:
        sock.close()
