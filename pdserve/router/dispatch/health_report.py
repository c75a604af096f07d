"""The cluster backend's /health body: each node as the router sees it, and the router's counters."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.router.dispatch.adapters import RouterAdapters
from pdserve.router.dispatch.drain import DrainTracker
from pdserve.router.dispatch.nodes import Node, NodePool
from pdserve.router.placement.index import PrefixIndex
from pdserve.router.placement.kv_events import KVEventTracker


@dataclass(frozen=True)
class HealthReport:
    pool: NodePool
    index: PrefixIndex
    kv_tracker: KVEventTracker
    drains: DrainTracker
    adapters: RouterAdapters
    transfer: str  # the router's --kv-transfer, reported as is

    def render(self, failover: dict) -> dict:
        """failover: the request paths' counters (retries, resumes, where prompts were placed)."""
        nodes = list(self.pool.nodes)
        return {"healthy": any(n.healthy and n.role == "decode" for n in nodes),
                "transfer": self.transfer,
                "nodes": [self.node_entry(n) for n in nodes],
                "failover": failover,
                "drain": dict(self.drains.counters),
                "kv_events": dict(self.kv_tracker.counters)}

    def node_entry(self, node: Node) -> dict:
        # "requests" is the node's own count from its last pong; "routed_requests" is this
        # router's, current at once.
        return {"id": node.node_id, "role": node.role, "address": node.address, "healthy": node.healthy,
                **node.stats, "routed_requests": len(node.requests),
                "index_blocks": self.index.size(node.node_id),
                "kv_event_seq_applied": self.kv_tracker.seq(node.node_id),
                "state": self.drains.state(node.node_id), **self.adapters.report(node.node_id),
                **({"refused": node.refusal} if node.refusal else {})}
