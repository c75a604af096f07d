"""The node registry: which nodes are up, at which addresses, in which role and state.

It runs inside the process that owns the nodes (the launcher, or the Ray controller actor), on
one zmq ROUTER socket at `tcp://HOST:PORT`, in a thread of its own:
  * nodes send Register at start and on every change, then a Heartbeat every HEARTBEAT_S; a
    record with no heartbeat for EXPIRE_AFTER_S is dropped, a Deregister drops it at once;
  * routers send SnapshotRequest every HEARTBEAT_S (that is their subscription and keep-alive)
    and get the whole Membership back; on every change each subscribed router is sent the new
    Membership at once. One address serves both, so a deployment configures one URL;
  * admin requests (ScaleRequest, SwitchRequest) are handed to the owner's callbacks on a worker
    thread, so starting a process never stalls heartbeats, and answered with an AdminReply.

Restarting the registry loses nothing that matters: a heartbeat for an unknown record is answered
RegistryAck(known=False) and the node registers again; routers keep their last membership until
the new one is complete (see router/scaling/registry_watcher.py).
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import zmq

from pdserve.cluster.registry_messages import (
    EXPIRE_AFTER_S,
    HEARTBEAT_S,
    AdminReply,
    Deregister,
    Heartbeat,
    Membership,
    NodeRecord,
    Register,
    RegistryAck,
    ScaleRequest,
    SnapshotRequest,
    SwitchRequest,
    decode,
    encode,
)

log = logging.getLogger(__name__)
POLL_MS = 100
AdminHandler = Callable[[ScaleRequest | SwitchRequest], AdminReply]


class RegistryServer:
    """Membership bookkeeping over one ROUTER socket, served from a background thread."""

    def __init__(self, bind: str, on_admin: AdminHandler | None = None):
        self.bind = bind
        self.on_admin = on_admin
        self.epoch = time.time_ns()
        self.version = 0
        self.records: dict[str, NodeRecord] = {}
        self.last_seen: dict[str, float] = {}
        self.subscribers: dict[bytes, float] = {}  # router identity -> monotonic time of its last request
        self._lock = threading.Lock()  # guards records for readers on other threads (members())
        self._admin = ThreadPoolExecutor(max_workers=1, thread_name_prefix="registry-admin")
        self._admin_done: list[tuple[bytes, Future]] = []
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._sock.bind(bind)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port for tcp://...:0
        self._thread = threading.Thread(target=self._serve, name="registry", daemon=True)

    def start(self) -> RegistryServer:
        self._thread.start()
        log.info("node registry on %s", self.address)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._admin.shutdown(wait=False, cancel_futures=True)

    def members(self) -> list[NodeRecord]:
        with self._lock:
            return list(self.records.values())

    # ---- the loop -------------------------------------------------------------------------
    def _serve(self) -> None:
        last_push = 0.0
        try:
            while not self._stop.is_set():
                if self._sock.poll(POLL_MS):
                    self._drain_socket()
                self._answer_admin()
                now = time.monotonic()
                if self._expire(now) or now - last_push >= HEARTBEAT_S:
                    self._push()
                    last_push = now
        finally:
            self._sock.close(0)

    def _drain_socket(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                log.warning("registry dropped a message with %d frames", len(frames))
                continue
            identity, payload = frames
            try:
                msg = decode(payload)
            except msgspec.DecodeError as exc:
                log.warning("registry dropped an undecodable message: %s", exc)
                continue
            self._handle(identity, msg)

    def _handle(self, identity: bytes, msg) -> None:
        if isinstance(msg, Register):
            self._send(identity, RegistryAck(True))
            if self._register(msg.record):
                self._push()
        elif isinstance(msg, Heartbeat):
            known = self._heartbeat(msg)
            self._send(identity, RegistryAck(known))
        elif isinstance(msg, Deregister):
            if self._deregister(msg):
                self._push()
        elif isinstance(msg, SnapshotRequest):
            self.subscribers[identity] = time.monotonic()
            self._send(identity, self._membership())
        elif isinstance(msg, ScaleRequest | SwitchRequest):
            self._start_admin(identity, msg)
        else:
            log.warning("registry ignores %s", type(msg).__name__)

    # ---- membership -----------------------------------------------------------------------
    def _register(self, record: NodeRecord) -> bool:
        """True when membership changed."""
        old = self.records.get(record.node_id)
        if old is not None and old.incarnation > record.incarnation:
            log.info("registry ignores a stale registration of %s (incarnation %d < %d)", record.node_id,
                     record.incarnation, old.incarnation)
            return False
        self.last_seen[record.node_id] = time.monotonic()
        if old == record:
            return False
        with self._lock:
            self.records[record.node_id] = record
        self.version += 1
        log.info("registry: %s %s %s at %s (%s, incarnation %d)", "updated" if old else "added",
                 record.role, record.node_id, record.control_addr, record.state, record.incarnation)
        return True

    def _heartbeat(self, msg: Heartbeat) -> bool:
        record = self.records.get(msg.node_id)
        if record is None or record.incarnation != msg.incarnation:
            return False
        self.last_seen[msg.node_id] = time.monotonic()
        return True

    def _deregister(self, msg: Deregister) -> bool:
        record = self.records.get(msg.node_id)
        if record is None or (msg.incarnation and msg.incarnation != record.incarnation):
            return False
        self._drop(msg.node_id, "deregistered")
        return True

    def _expire(self, now: float) -> bool:
        stale = [nid for nid, seen in self.last_seen.items() if now - seen > EXPIRE_AFTER_S]
        for nid in stale:
            self._drop(nid, f"sent no heartbeat for {now - self.last_seen[nid]:.1f} s")
        # A router asks every HEARTBEAT_S: kept for three asks, apart from the records' expiry (a
        # shorter expiry would drop it between asks, and it would miss the pushes in between).
        for identity in [i for i, seen in self.subscribers.items() if now - seen > 3 * HEARTBEAT_S]:
            del self.subscribers[identity]  # a router that stopped asking is gone
        return bool(stale)

    def _drop(self, node_id: str, why: str) -> None:
        with self._lock:
            record = self.records.pop(node_id, None)
        self.last_seen.pop(node_id, None)
        if record is not None:
            self.version += 1
            log.info("registry: removed %s (%s): %s", node_id, record.control_addr, why)

    def _membership(self) -> Membership:
        return Membership(self.version, list(self.records.values()), self.epoch)

    def _push(self) -> None:
        membership = self._membership()
        for identity in self.subscribers:
            self._send(identity, membership)

    def _send(self, identity: bytes, msg) -> None:
        try:
            self._sock.send_multipart([identity, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a vanished or slow peer must not stop the registry
            log.debug("registry send failed: %s", exc)

    # ---- admin ----------------------------------------------------------------------------
    def _start_admin(self, identity: bytes, msg: ScaleRequest | SwitchRequest) -> None:
        if self.on_admin is None:
            self._send(identity, AdminReply(False, "this registry's owner takes no admin requests"))
            return
        self._admin_done.append((identity, self._admin.submit(self.on_admin, msg)))

    def _answer_admin(self) -> None:
        pending = []
        for identity, fut in self._admin_done:
            if not fut.done():
                pending.append((identity, fut))
                continue
            try:
                reply = fut.result()
            except Exception as exc:  # an owner's failure is the caller's answer, not the registry's end
                log.exception("admin request failed")
                reply = AdminReply(False, f"{type(exc).__name__}: {exc}")
            self._send(identity, reply)
        self._admin_done = pending


def run_registry(args) -> int:
    """`pdserve registry`: a registry of its own, for nodes and routers started by hand (compose,
    bare hosts); `pdserve up` and `pdserve up --ray` host theirs inside the owner."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = RegistryServer(args.bind).start()
    print(f"pdserve registry on {server.address}", flush=True)
    stop.wait()
    server.stop()
    return 0
