"""/v1/embeddings over the cluster (`backend`: a router.cluster.ClusterBackend, not imported: it
imports this module): one EmbedRequest to one node, one EmbedResult back.

Prefill nodes serve embeddings (they run whole prompts already, and decode nodes keep their
batch); in the monolithic mode (no prefill node configured) decode nodes do, and so do they when
every prefill node stays gone. A node lost mid-request (or silent past PREFILL_TIMEOUT_S) moves
the request to another, as a prefill is moved.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from pdserve.router.dispatch.backend import BackendError
from pdserve.router.dispatch.failover import MAX_ATTEMPTS, PREFILL_TIMEOUT_S, NodeLost
from pdserve.router.dispatch.nodes import Node
from pdserve.wire.messages import Abort, EmbedRequest, EmbedResult

log = logging.getLogger(__name__)


async def _node_for(backend: Any, tried: set[str]) -> Node | None:
    if backend.pool.by_role("prefill", healthy_only=False):
        node = await backend._await_node("prefill", tried)
        if node is not None and node.node_id not in tried:
            return node
    node = await backend._await_node("decode", tried)
    return node if node is not None and node.node_id not in tried else None


async def embed_on_nodes(backend: Any, rid: str, prompts: list[list[int]], pooling: str) -> EmbedResult:
    tried: set[str] = set()
    for attempt in range(MAX_ATTEMPTS):
        node = await _node_for(backend, tried)
        if node is None:
            break
        tried.add(node.node_id)
        try:
            result = await _embed_on(backend, node, rid, prompts, pooling)
        except NodeLost as exc:
            log.warning("[%s] embedding on %s lost (%s): attempt %d of %d", rid, node.node_id, exc,
                        attempt + 1, MAX_ATTEMPTS)
            continue
        if result.error is not None:
            raise BackendError(f"embedding failed: {result.error}")
        return result
    raise BackendError("no healthy node could compute the embeddings")


async def _embed_on(backend: Any, node: Node, rid: str, prompts: list[list[int]],
                    pooling: str) -> EmbedResult:
    fut = asyncio.get_running_loop().create_future()
    backend.prefill_results[rid] = fut  # answered, or failed with NodeLost, like a prefill
    backend.owner[rid] = node.node_id
    node.requests.add(rid)
    try:
        await backend.pool.send(node, EmbedRequest(rid, prompts, pooling))
        return await asyncio.wait_for(fut, PREFILL_TIMEOUT_S)
    except asyncio.TimeoutError:
        backend.pool.mark_dead(node, f"did not answer an embedding in {PREFILL_TIMEOUT_S:.0f} s")
        raise NodeLost(node.node_id) from None
    except asyncio.CancelledError:  # the client went away: the node drops the work
        await asyncio.shield(backend.pool.send(node, Abort(rid)))
        raise
    finally:
        backend.prefill_results.pop(rid, None)
        backend.owner.pop(rid, None)
        node.requests.discard(rid)
