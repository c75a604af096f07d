"""Scaling a running cluster from the router: more or fewer nodes per role, and role switches.

The router decides which nodes go (the ones with the least in flight) and runs their drain,
since it holds the streams to move; the node owner (`pdserve up`'s launcher, reached over its
zmq admin socket) starts and stops the processes. A node started joins the rotation at its first
pong; a node removed drains first (no request is lost), then the owner stops it. A role switch
needs no owner: the node drains and rebuilds itself as the other role in place.
"""
from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from pdserve.router.dispatch.drain import DrainTracker
from pdserve.router.dispatch.nodes import Node, NodePool
from pdserve.wire.messages import (
    ROLES,
    Drain,
    ListNodes,
    Message,
    OwnerReply,
    SetNodeRole,
    StartNode,
    StopNode,
    decode,
    encode,
)

log = logging.getLogger(__name__)
OWNER_TIMEOUT_S = 30.0
DRAIN_TIMEOUT_S = 120.0  # past this a node is stopped anyway: its streams moved long before
JOIN_TIMEOUT_S = 300.0   # a new node loads its weights before its first pong


class ScaleError(Exception):
    """The request cannot be carried out as asked (bad target, no owner): a 4xx."""


class OwnerClient:
    """Requests to the process owner over its zmq admin socket, one at a time."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._lock = asyncio.Lock()

    async def request(self, msg: Message) -> OwnerReply:
        async with self._lock:
            sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            try:
                await sock.send(encode(msg))
                if not await sock.poll(OWNER_TIMEOUT_S * 1000):
                    raise ScaleError(f"the node owner at {self.address} did not answer")
                reply = decode(await sock.recv())
            finally:
                sock.close(0)
        if not isinstance(reply, OwnerReply):
            raise ScaleError(f"unexpected reply from the node owner: {type(reply).__name__}")
        return reply


class Scaler:
    def __init__(self, pool: NodePool, drains: DrainTracker, owner: OwnerClient | None = None) -> None:
        self.pool = pool
        self.drains = drains
        self.owner = owner  # None: no node owner, so role switches only
        self._lock = asyncio.Lock()  # one scale or switch at a time
        self.counters = {"scale_up": 0, "scale_down": 0, "switch": 0}

    def active(self, role: str) -> list[Node]:
        """Nodes of `role` taking new work (healthy or still joining), not draining."""
        return [n for n in self.pool.nodes if n.role == role and not n.draining and not n.closed]

    def describe(self) -> dict:
        drains = self.drains
        nodes = [{"id": n.node_id, "role": n.role, "address": n.address, "healthy": n.healthy,
                  "state": drains.state(n.node_id), "draining": n.draining, "in_flight": len(n.requests),
                  "tensor_parallel_size": n.stats.get("tensor_parallel_size", 1)}
                 for n in self.pool.nodes]
        return {"nodes": nodes, "owner": self.owner.address if self.owner else None,
                "counts": {r: len(self.active(r)) for r in ROLES}, "actions": dict(self.counters)}

    # ---- scale ------------------------------------------------------------------------------
    async def scale(self, targets: dict[str, int | None], wait: bool = True, grace_s: float | None = None,
                    prefer_removing: tuple[str, ...] = ()) -> dict:
        """Start or drain-and-stop nodes until each role in `targets` has that many active nodes.
        grace_s: how long decode streams may run on a removed node before they move elsewhere.
        prefer_removing: node ids to remove first; then the ones with the least in flight go."""
        for role, n in targets.items():
            if n is not None and (n < 0 or (role == "decode" and n < 1)):
                raise ScaleError(f"{role} must be at least {1 if role == 'decode' else 0}, not {n}")
        if self.owner is None:
            raise ScaleError("this router has no node owner to start or stop nodes (clusters from "
                             "`pdserve up` have one); a role switch needs none")
        async with self._lock:
            started = time.perf_counter()
            added: list[Node] = []
            victims: list[Node] = []
            for role, target in targets.items():
                if target is None:
                    continue
                have = self.active(role)
                for _ in range(target - len(have)):
                    added.append(await self._start(role))
                order = sorted(have, key=lambda n: (n.node_id not in prefer_removing, len(n.requests), n.node_id))
                victims += order[:max(len(have) - target, 0)]
            await asyncio.gather(*(self._remove(n, grace_s) for n in victims))
            if wait:
                await self._wait(lambda: all(self._serving(n.node_id, n.role) for n in added), JOIN_TIMEOUT_S,
                                 "new nodes to join")
            return {"added": [n.node_id for n in added], "removed": [n.node_id for n in victims],
                    "seconds": round(time.perf_counter() - started, 3), **self.describe()}

    async def _start(self, role: str) -> Node:
        reply = await self.owner.request(StartNode(role))
        if not reply.ok:
            raise ScaleError(f"the node owner could not start a {role} node: {reply.detail}")
        node = self.pool.get(reply.node_id) or self.pool.add_node(reply.node_id, role, reply.address)
        self.counters["scale_up"] += 1
        log.info("scale: started %s at %s", reply.node_id, reply.address)
        return node

    async def _remove(self, node: Node, grace_s: float | None) -> None:
        await self.drain(node, grace_s=grace_s)
        reply = await self.owner.request(StopNode(node.node_id))
        if not reply.ok:
            log.warning("scale: the owner could not stop %s: %s", node.node_id, reply.detail)
        await self.pool.remove_node(node.node_id)
        self.counters["scale_down"] += 1
        log.info("scale: %s drained and stopped", node.node_id)

    async def drain(self, node: Node, to_role: str = "", grace_s: float | None = None) -> None:
        node.draining = True  # out of this router's rotation at once; the pongs confirm it
        if grace_s is not None:
            self.drains.set_grace(node.node_id, grace_s)
        await self.pool.send(node, Drain(to_role))
        if not to_role:
            try:
                await self._wait(lambda: self._drained(node.node_id), DRAIN_TIMEOUT_S, f"{node.node_id} to drain")
            except ScaleError:
                log.warning("scale: %s did not drain in %.0f s: stopping it anyway", node.node_id, DRAIN_TIMEOUT_S)

    # ---- switch -----------------------------------------------------------------------------
    async def switch(self, node_id: str, to_role: str, grace_s: float | None = None) -> dict:
        if to_role not in ROLES:
            raise ScaleError(f"to_role must be one of {list(ROLES)}, not {to_role!r}")
        async with self._lock:
            # Checked under the lock: a scale that held it may have removed the node (drained it
            # while this call waited), or a switch before this one may have moved it already.
            node = self._switchable(node_id, to_role)
            started = time.perf_counter()
            await self.drain(node, to_role, grace_s)
            await self._wait(lambda: self._serving(node_id, to_role), DRAIN_TIMEOUT_S,
                             f"{node_id} to switch to {to_role}")
            self.counters["switch"] += 1
            await self._tell_owner_role(node_id, to_role)
            return {"node": node_id, "role": to_role, "seconds": round(time.perf_counter() - started, 3),
                    **self.describe()}

    def _switchable(self, node_id: str, to_role: str) -> Node:
        node = self.pool.get(node_id)
        if node is None or node.closed:
            raise ScaleError(f"no node {node_id!r}")
        if node.role == to_role:
            raise ScaleError(f"{node_id} is a {to_role} node already")
        if node.role == "decode" and len([n for n in self.active("decode") if n is not node]) == 0:
            raise ScaleError(f"{node_id} is the last decode node: start another before switching it")
        return node

    async def _tell_owner_role(self, node_id: str, role: str) -> None:
        """So that the owner restarts the node in its new role should its process die (a node
        the owner did not start, or an owner that cannot be reached, keeps the switch anyway)."""
        if self.owner is None:
            return
        try:
            reply = await self.owner.request(SetNodeRole(node_id, role))
        except ScaleError as exc:
            log.warning("switch: could not tell the node owner that %s is a %s node now: %s", node_id, role, exc)
            return
        if not reply.ok:
            log.warning("switch: the node owner did not record %s as a %s node: %s", node_id, role, reply.detail)

    # A registry watcher may replace a node's Node object (a role change re-adds it): look nodes
    # up by id each time.
    def _drained(self, node_id: str) -> bool:
        node = self.pool.get(node_id)
        return node is None or not node.healthy or self.drains.drained(node)

    def _serving(self, node_id: str, role: str) -> bool:
        node = self.pool.get(node_id)
        return node is not None and node.role == role and not node.draining and node.healthy

    async def owned(self) -> dict[str, str]:
        if self.owner is None:
            return {}
        return (await self.owner.request(ListNodes())).nodes

    @staticmethod
    async def _wait(done, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise ScaleError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            await asyncio.sleep(0.05)
