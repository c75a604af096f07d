"""The cluster backend's /health body: each node as the router sees it, and the router's counters."""
from __future__ import annotations

from typing import Any

from pdserve.router.dispatch.nodes import Node


def node_entry(backend: Any, node: Node) -> dict:
    # "requests" is the node's own count from its last pong; "routed_requests" is this
    # router's, current at once.
    return {"id": node.node_id, "role": node.role, "address": node.address, "healthy": node.healthy,
            **node.stats, "routed_requests": len(node.requests),
            "index_blocks": backend.index.size(node.node_id),
            "kv_event_seq_applied": backend.kv_tracker.seq(node.node_id),
            "state": backend.drains.state(node.node_id), **_adapters(backend, node)}


def _adapters(backend: Any, node: Node) -> dict:
    """The node's LoRA adapters from its last pong: registered and resident in its slots."""
    state = backend.adapters.nodes.get(node.node_id)
    return {"loras": sorted(state.registered), "active_loras": sorted(state.active)} if state else {}


def cluster_health(backend: Any) -> dict:
    """backend: a router.cluster.ClusterBackend (not imported: it imports this module)."""
    nodes = list(backend.nodes)
    return {"healthy": any(n.healthy and n.role == "decode" for n in nodes),
            "transfer": backend.transfer,
            "nodes": [node_entry(backend, n) for n in nodes],
            "failover": dict(backend.counters),
            "drain": dict(backend.drains.counters),
            "kv_events": dict(backend.kv_tracker.counters)}
