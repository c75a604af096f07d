"""The router's side of draining: what it does when a node says (in its pongs) that it drains.

A node's own state is what every router follows: once told to drain (by whichever router runs
the scale or switch), it reports "draining" until its work is done, then "drained". Each router
that sees this takes the node out of its rotation and moves its own requests off it:
  * decode streams still there after DECODE_GRACE_S resume on another decode node through the
    failover path (the new node recomputes prompt + tokens so far, or finds them cached), so a
    drain never waits for a long generation;
  * prefills are short: they finish there, or past PREFILL_GRACE_S are retried elsewhere.
A node that switched roles answers "active" under its new role and rejoins the rotation as such;
the prefix index keeps its blocks, since its KV cache survived the switch.
"""
from __future__ import annotations

import asyncio
import logging
import time

from pdserve.router.dispatch.inflight import Inflight
from pdserve.router.dispatch.nodes import Node
from pdserve.wire.messages import ROLES, Pong

log = logging.getLogger(__name__)
DECODE_GRACE_S = 2.0
PREFILL_GRACE_S = 30.0
MOVE_CHECK_S = 0.25


class DrainTracker:
    def __init__(self, inflight: Inflight) -> None:
        self.inflight = inflight  # the requests on the nodes: moved off a draining one
        self.states: dict[str, str] = {}  # node id -> the state its last pong reported
        self._movers: dict[str, asyncio.Task] = {}
        self.grace_s: dict[str, float] = {}  # node id -> decode grace asked for by this router's admin
        self.counters = {"streams_moved": 0, "prefills_moved": 0, "role_switches": 0}

    def state(self, node_id: str) -> str:
        return self.states.get(node_id, "active")

    def on_pong(self, node: Node, pong: Pong) -> None:
        previous = self.states.get(node.node_id, "active")
        node_role_before = node.role
        self.states[node.node_id] = pong.state
        if pong.role != node.role and pong.role in ROLES:
            log.info("%s serves %s now (was %s)", node.node_id, pong.role, node.role)
            node.role = pong.role
            self.counters["role_switches"] += 1
        if pong.state != "active":
            if not node.draining:
                log.info("%s is draining: out of rotation, %d requests to finish or move", node.node_id,
                         len(node.requests))
            node.draining = True
            if node.node_id not in self._movers:
                self._movers[node.node_id] = asyncio.get_running_loop().create_task(self._move_off(node))
        elif previous != "active" or node.draining and pong.role != node_role_before:
            # The drain ended: cancelled, or the node switched roles (maybe between two pongs).
            node.draining = False
            self.grace_s.pop(node.node_id, None)
            self._stop_mover(node.node_id)

    def set_grace(self, node_id: str, grace_s: float) -> None:
        """How long decode streams may stay on this node once it drains (this router's admin asked)."""
        self.grace_s[node_id] = grace_s

    def drained(self, node: Node) -> bool:
        """The node reports nothing in flight and this router has nothing on it."""
        return self.state(node.node_id) == "drained" and not node.requests

    async def _move_off(self, node: Node) -> None:
        """Move this router's requests off a draining node, checking as new ones may still land
        (sent just before the router saw the drain)."""
        seen: dict[str, float] = {}  # request id -> when this router first saw it on the draining node
        try:
            while node.draining and not node.closed:
                now = time.monotonic()
                for rid in node.requests:
                    seen.setdefault(rid, now)
                grace = self.grace_s.get(node.node_id, DECODE_GRACE_S)
                prefilling = {r for r in node.requests if self.inflight.awaits_reply(r, node.node_id)}
                streams = [r for r in node.requests if r not in prefilling and now - seen[r] >= grace]
                prefills = [r for r in node.requests if r in prefilling and now - seen[r] >= PREFILL_GRACE_S]
                self.counters["streams_moved"] += self.inflight.move(node, streams, planned=True)
                self.counters["prefills_moved"] += self.inflight.move(node, prefills, planned=True)
                await asyncio.sleep(MOVE_CHECK_S)
        finally:
            self._movers.pop(node.node_id, None)

    def _stop_mover(self, node_id: str) -> None:
        task = self._movers.pop(node_id, None)
        if task is not None:
            task.cancel()

    def cancel(self) -> None:
        for node_id in list(self._movers):
            self._stop_mover(node_id)
