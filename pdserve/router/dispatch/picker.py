"""Which node of a role takes a phase of a request when placement named none, or the one it
named is gone: round robin over the healthy nodes, waiting a while for one when every node of
the role is out of rotation but some are only silent."""
from __future__ import annotations

import asyncio
import itertools
import time

from pdserve.router.dispatch.nodes import Node, NodePool

# How long a request waits for a node of a role when every one is out of rotation but some are
# only silent (still connected: a loaded host missing pings), not dead. A loaded 2-core host
# (a node process starting beside the survivors of a failover) kept every node silent for over
# 10 s: a connected node is worth waiting for well past that.
NODE_WAIT_S = 30.0


class NodePicker:
    def __init__(self, pool: NodePool):
        self.pool = pool
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}

    def preferred(self, node_id: str | None, tried: set[str]) -> Node | None:
        """The node placement chose, while it is usable and not tried yet."""
        node = self.pool.get(node_id) if node_id is not None else None
        usable = node is not None and node.healthy and not node.draining
        return node if usable and node_id not in tried else None

    def pick(self, role: str, exclude: set[str] = frozenset()) -> Node | None:
        healthy = [n for n in self.pool.by_role(role) if n.node_id not in exclude]
        if not healthy:
            return None
        return healthy[next(self._rr[role]) % len(healthy)]

    async def await_node(self, role: str, exclude: set[str] = frozenset()) -> Node | None:
        """A healthy node of `role`, outside `exclude` where one is; None once none can come back
        within NODE_WAIT_S (every node of the role disconnected, or the wait ran out)."""
        deadline = time.monotonic() + NODE_WAIT_S
        while True:
            node = self.pick(role, exclude) or self.pick(role)
            if node is not None:
                return node
            silent = [n for n in self.pool.by_role(role, healthy_only=False) if not n.disconnected]
            if not silent or time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.05)
