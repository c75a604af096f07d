"""/v1/embeddings over the cluster: one EmbedRequest to one node, one EmbedResult back.

Prefill nodes serve embeddings (they run whole prompts already, and decode nodes keep their
batch); in the monolithic mode (no prefill node configured) decode nodes do, and so do they when
every prefill node stays gone. A node lost mid-request (or silent past PREFILL_TIMEOUT_S) moves
the request to another, as a prefill is moved.
"""
from __future__ import annotations

import asyncio
import logging

from pdserve.router.dispatch.backend import BackendError
from pdserve.router.dispatch.failover import MAX_ATTEMPTS, PREFILL_TIMEOUT_S, NodeLost
from pdserve.router.dispatch.inflight import Inflight
from pdserve.router.dispatch.nodes import Node, NodePool
from pdserve.router.dispatch.picker import NodePicker
from pdserve.wire.messages import Abort, EmbedRequest, EmbedResult

log = logging.getLogger(__name__)


class EmbeddingDispatch:
    def __init__(self, pool: NodePool, inflight: Inflight, picker: NodePicker):
        self.pool = pool
        self.inflight = inflight
        self.picker = picker

    async def embed(self, rid: str, prompts: list[list[int]], pooling: str) -> EmbedResult:
        tried: set[str] = set()
        for attempt in range(MAX_ATTEMPTS):
            node = await self._node_for(tried)
            if node is None:
                break
            tried.add(node.node_id)
            try:
                result = await self._embed_on(node, rid, prompts, pooling)
            except NodeLost as exc:
                log.warning("[%s] embedding on %s lost (%s): attempt %d of %d", rid, node.node_id, exc,
                            attempt + 1, MAX_ATTEMPTS)
                continue
            if result.error is not None:
                raise BackendError(f"embedding failed: {result.error}")
            return result
        raise BackendError("no healthy node could compute the embeddings")

    async def _node_for(self, tried: set[str]) -> Node | None:
        if self.pool.by_role("prefill", healthy_only=False):
            node = await self.picker.await_node("prefill", tried)
            if node is not None and node.node_id not in tried:
                return node
        node = await self.picker.await_node("decode", tried)
        return node if node is not None and node.node_id not in tried else None

    async def _embed_on(self, node: Node, rid: str, prompts: list[list[int]], pooling: str) -> EmbedResult:
        fut = self.inflight.expect_reply(rid, node)  # answered, or failed with NodeLost, like a prefill
        node.requests.add(rid)
        try:
            await self.pool.send(node, EmbedRequest(rid, prompts, pooling))
            return await asyncio.wait_for(fut, PREFILL_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.pool.mark_dead(node, f"did not answer an embedding in {PREFILL_TIMEOUT_S:.0f} s", "silent")
            raise NodeLost(node.node_id) from None
        except asyncio.CancelledError:  # the client went away: the node drops the work
            await asyncio.shield(self.pool.send(node, Abort(rid)))
            raise
        finally:
            self.inflight.drop_reply(rid, release=True)
            node.requests.discard(rid)
