"""The router's connections to its nodes: one zmq DEALER per node, pings, and death detection.

A node is declared dead the moment its TCP connection drops (a zmq socket monitor sees the
disconnect; a killed process's kernel closes it at once) or after DEAD_AFTER_S without a Pong
(a hung or unreachable node). Either way it leaves the rotation at once and the cluster is told,
so the requests it held move elsewhere. It rejoins on its next Pong.

The pool's membership changes at run time (add_node/remove_node, driven by the registry watcher):
a node added joins the rotation at its first Pong; a node removed is treated as dead first, so
its requests move, then its socket closes. A draining node stays connected and keeps its
in-flight requests but is handed no new ones.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.router.dispatch.compat_gate import CompatGate
from pdserve.wire.compat import KVCompat
from pdserve.wire.curve_keys import RouterKeys
from pdserve.wire.messages import WIRE_VERSION, Message, Ping, Pong, decode, encode

log = logging.getLogger(__name__)
PING_INTERVAL_S = 0.2
# Pongs are answered by the node's loop between engine steps; a long prefill chunk on a loaded
# 2-core machine can delay one by several hundred ms, so this is well above a step.
DEAD_AFTER_S = 1.5
STALL_CREDIT_AFTER_S = 0.1  # a health-loop tick later than this is the router's lag, not the nodes'


@dataclass
class Node:
    node_id: str
    role: str
    address: str
    sock: zmq.asyncio.Socket
    healthy: bool = False
    last_pong: float = 0.0
    stats: dict = field(default_factory=dict)
    requests: set[str] = field(default_factory=set)  # request ids in flight on this node
    # ... of them, push-mode requests that wait here for a prompt another node computes: not
    # decode rows yet (node_view), as pull mode's would not be here at all until their handover
    pushed: set[str] = field(default_factory=set)
    disconnected: bool = False  # its TCP connection closed (a dead process), not merely silent
    kv_salt: bytes = b""  # the node's block-key salt, from its pongs
    queued_tokens: dict[str, int] = field(default_factory=dict)  # request id -> prompt tokens sent to prefill
    whole: set[str] = field(default_factory=set)  # on a prefill node: requests it also decodes
    draining: bool = False  # finishing its requests; no new ones are routed to it
    nixl_side_channel: str | None = None  # as the node registered it (None for static nodes)
    closed: bool = False  # removed from the pool: its socket is closed
    refused: bool = False  # its pongs speak another WIRE_VERSION or its KV differs: out of the rotation
    refusal: str = ""  # why it is refused, for /health
    added_at: float = field(default_factory=time.monotonic)

    def awaiting_first_pong(self) -> bool:
        """Added less than a dead node's silence ago and not heard from yet: neither dead nor healthy."""
        return not self.last_pong and time.monotonic() - self.added_at < DEAD_AFTER_S


@dataclass
class NodeFaults:
    """The faults the router saw, by node id, for /metrics. Kept by the pool, not the Node: a
    restarted node that registers anew is a new Node, and a counter must never go back."""
    losses: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (node, role, reason) -> times
    rejoins: dict[tuple[str, str], int] = field(default_factory=dict)  # (node, role) -> times

    def lost(self, node: Node, reason: str) -> None:
        key = (node.node_id, node.role, reason)
        self.losses[key] = self.losses.get(key, 0) + 1

    def answered(self, node: Node) -> None:
        """An unhealthy node answered: a return, if the router had lost it before."""
        if any(k[0] == node.node_id for k in self.losses):
            key = (node.node_id, node.role)
            self.rejoins[key] = self.rejoins.get(key, 0) + 1


class NodePool:
    """Keeps every node's health current and hands each decoded message to `on_message`
    (given here or, by the router's main, through listen). curve: the router's CURVE keys
    (--curve-dir), or None for plain TCP."""

    def __init__(self, prefill_addrs: list[str], decode_addrs: list[str],
                 on_message: Callable[[Node, Message], None] | None = None,
                 on_dead: Callable[[Node], None] | None = None, curve: RouterKeys | None = None,
                 encode_addrs: list[str] = ()):
        self.ctx = zmq.asyncio.Context.instance()
        self.curve = curve
        # One live list: metrics and the cluster hold references to it, so it is changed in place.
        self.nodes = [self._connect(f"prefill-{i}", "prefill", a) for i, a in enumerate(prefill_addrs)]
        self.nodes += [self._connect(f"decode-{i}", "decode", a) for i, a in enumerate(decode_addrs)]
        self.nodes += [self._connect(f"encode-{i}", "encode", a) for i, a in enumerate(encode_addrs)]
        self.on_message = on_message
        self.on_dead = on_dead
        self.compat = CompatGate()  # which nodes' KV agrees: only those are paired
        self.faults = NodeFaults()
        self._tasks: list[asyncio.Task] = []
        self._node_tasks: dict[str, list[asyncio.Task]] = {}
        self._background: set[asyncio.Task] = set()  # sends scheduled from callbacks (send_later)
        self._started = False

    def listen(self, on_message: Callable[[Node, Message], None], on_dead: Callable[[Node], None]) -> None:
        """Where the nodes' messages and deaths go (set before start)."""
        self.on_message = on_message
        self.on_dead = on_dead

    def kv_salts(self) -> list[bytes]:
        """The distinct block-key salts the healthy nodes report, sorted."""
        return sorted({n.kv_salt for n in self.nodes if n.healthy and n.kv_salt})

    def _connect(self, node_id: str, role: str, address: str) -> Node:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)  # a restarted node is back within 100 ms
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if self.curve is not None:
            self.curve.apply(sock)
        sock.connect(address)
        return Node(node_id, role, address, sock)

    def by_role(self, role: str, healthy_only: bool = True) -> list[Node]:
        """The nodes of `role` that may take new requests: never a draining or refused one."""
        return [n for n in self.nodes if n.role == role and not n.draining and not n.refused
                and (n.healthy or not healthy_only)]

    def get(self, node_id: str) -> Node | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    def add_node(self, node_id: str, role: str, address: str, nixl_side_channel: str | None = None) -> Node:
        """Connect to a node found at run time; it joins the rotation at its first Pong."""
        if self.get(node_id) is not None:
            raise ValueError(f"node {node_id} is already in the pool")
        node = self._connect(node_id, role, address)
        node.nixl_side_channel = nixl_side_channel
        self.nodes.append(node)
        if self._started:
            self._start_node_tasks(node)
        log.info("%s (%s, %s) added", node_id, role, address)
        return node

    async def remove_node(self, node_id: str) -> None:
        """Drop a node that left: its requests move elsewhere as for a dead node, then its
        socket closes. Unknown ids are ignored (the registry and the pool may race)."""
        node = self.get(node_id)
        if node is None:
            return
        self.mark_dead(node, "left the cluster", "removed")
        self.nodes.remove(node)
        self.compat.forget(node_id)
        tasks = self._node_tasks.pop(node_id, [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        node.closed = True
        node.sock.close(0)
        log.info("%s (%s) removed", node_id, node.address)

    def _start_node_tasks(self, node: Node) -> None:
        self._node_tasks[node.node_id] = [asyncio.create_task(self._receive(node)),
                                          asyncio.create_task(self._watch_connection(node))]

    async def start(self) -> None:
        self._started = True
        for node in self.nodes:
            self._start_node_tasks(node)
        self._tasks.append(asyncio.create_task(self._health_loop()))

    async def stop(self) -> None:
        tasks = self._tasks + [t for ts in self._node_tasks.values() for t in ts]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._node_tasks.clear()
        for node in self.nodes:
            node.closed = True
            node.sock.close(0)

    async def send(self, node: Node, msg: Message) -> None:
        if node.closed:  # removed while a request still held it: nothing to send to
            return
        await node.sock.send(encode(msg))

    def send_later(self, node_id: str, msg: Message) -> None:
        """Send from a callback (not a coroutine): scheduled on the loop; a node not in the pool gets nothing."""
        node = self.get(node_id)
        if node is None:
            return
        task = asyncio.get_running_loop().create_task(self.send(node, msg))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def mark_dead(self, node: Node, why: str, reason: str) -> None:
        """reason: the loss's label in /metrics (disconnected, silent, refused, removed)."""
        if not node.healthy:
            return
        node.healthy = False
        self.faults.lost(node, reason)
        log.warning("%s (%s) %s: out of rotation; moving its %d requests", node.node_id, node.address,
                    why, len(node.requests))
        self.on_dead(node)
        node.requests.clear()
        node.queued_tokens.clear()

    # ---- background tasks -------------------------------------------------------------------
    async def _health_loop(self) -> None:
        last_tick = time.monotonic()
        for seq in itertools.count():
            now = time.monotonic()
            self._credit_router_stall(now - last_tick - PING_INTERVAL_S)
            last_tick = now
            for node in list(self.nodes):  # a copy: membership may change while a send waits
                if node.healthy and now - node.last_pong > DEAD_AFTER_S:
                    self.mark_dead(node, f"sent no pong for {now - node.last_pong:.1f} s", "silent")
                await self.send(node, Ping(seq))
            await asyncio.sleep(PING_INTERVAL_S)

    def _credit_router_stall(self, stall_s: float) -> None:
        """Pongs that arrived while the router's own loop was stalled (a busy host) sit unread in
        the sockets: that time must not count against the nodes, or every node looks dead at
        once and the requests moved around overload what is left."""
        if stall_s > STALL_CREDIT_AFTER_S:
            for node in self.nodes:
                node.last_pong += stall_s

    async def _watch_connection(self, node: Node) -> None:
        monitor = node.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    node.disconnected = True
                    self.mark_dead(node, "closed its connection", "disconnected")
        finally:
            monitor.close(0)

    async def _receive(self, node: Node) -> None:
        while True:
            try:
                msg = decode(await node.sock.recv())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a malformed message is dropped, never fatal
                log.warning("bad message from %s: %s", node.node_id, exc)
                continue
            if isinstance(msg, Pong) and not self.take_pong(node, msg):
                continue  # a refused node's pongs go no further
            self.on_message(node, msg)

    def take_pong(self, node: Node, msg: Pong) -> bool:
        """Update the node's health from its pong; False when the node is refused."""
        if self._compat_refused(node, msg):
            return False
        was_healthy = node.healthy
        self._on_pong(node, msg)
        if node.healthy and not was_healthy:
            self.faults.answered(node)
        return True

    @staticmethod
    def _on_pong(node: Node, msg: Pong) -> None:
        if msg.version != WIRE_VERSION:
            if not node.refused:
                log.error("%s (%s) speaks wire version %d, this router %d: not routing to it; upgrade "
                          "routers and nodes together", node.node_id, node.address, msg.version, WIRE_VERSION)
            node.refused, node.healthy = True, False
            return
        node.refused = False
        if not node.healthy:
            log.info("%s (%s) is healthy", node.node_id, node.address)
        node.healthy, node.last_pong, node.disconnected = True, time.monotonic(), False
        node.kv_salt = msg.kv_salt or node.kv_salt
        node.stats = {"requests": msg.num_requests, "free_blocks": msg.free_blocks,
                      "total_blocks": msg.total_blocks, **msg.stats}

    def check_registered(self, node: Node, compat: KVCompat) -> None:
        """A node that registered with KV the admitted group's differs from is refused at once,
        before its first pong could put it in the rotation."""
        self._refused(node, compat, " at registration")

    def _compat_refused(self, node: Node, msg: Pong) -> bool:
        return self._refused(node, msg.compat, "")

    def _refused(self, node: Node, compat: KVCompat | None, when: str) -> bool:
        """A node whose KV differs from the admitted group's stays out of the rotation (the
        reason logged once and in /health); requests it holds move elsewhere."""
        if compat is not None:
            self.compat.report(node.node_id, node.role, compat)
        why = self.compat.refusal(node.node_id)
        if why is None:
            node.refusal = ""
            return False
        if node.refusal != why:
            log.error("%s (%s) refused%s: it computes other KV than the nodes it would pair with (%s); no "
                      "request is routed to it", node.node_id, node.address, when, why)
        node.refused, node.refusal = True, why
        self.mark_dead(node, "was refused", "refused")  # (a node just registered is not in rotation yet)
        return True
