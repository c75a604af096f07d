"""E/P/D: a request's images go to an encoder node before the prefill, which then takes their
embeddings instead of encoding them (pdserve.node.encode): READ over NIXL from where the encoder
node's answer says they wait (passed on in the PrefillRequest), or loaded from the store.

The encoder node is chosen by the first image's hash (rendezvous hashing over the healthy
encoder nodes), so a repeated image meets the node whose encoder cache holds it, and a node
that joins or leaves moves only its share of the images. Encoding is an optimisation, never a
dependency: with no encoder node up, or one that fails, errs or stays silent past
ENCODE_TIMEOUT_S, the request goes on and the prefill node encodes the images itself.
"""
from __future__ import annotations

import asyncio
import logging

import xxhash

from pdserve.protocol.multimodal import ImageInput
from pdserve.router.dispatch.failover import NodeLost
from pdserve.router.dispatch.inflight import Inflight
from pdserve.router.dispatch.nodes import Node, NodePool
from pdserve.wire.embedding_handover import EmbeddingHandover
from pdserve.wire.messages import EncodeRequest

log = logging.getLogger(__name__)
ENCODE_TIMEOUT_S = 30.0


def pick_encoder(nodes: list[Node], content_hash: str) -> Node | None:
    """The node with the highest rendezvous score for this image."""
    return max(nodes, key=lambda n: xxhash.xxh64_intdigest(f"{n.node_id}|{content_hash}".encode()), default=None)


class EncodeDispatch:
    def __init__(self, pool: NodePool, inflight: Inflight):
        self.pool, self.inflight = pool, inflight
        self.counters = {"encodes_remote": 0, "encode_fallbacks": 0}

    async def encode(self, rid: str, images: tuple[ImageInput, ...]) -> list[EmbeddingHandover]:
        """Each image's NIXL handover when an encoder node encoded them and handed them over by NIXL
        ([] when through the store, or when the prefill node encodes: no encoder node, or it failed)."""
        node = pick_encoder(self.pool.by_role("encode"), images[0].content_hash) if images else None
        if node is None:
            return []
        encode_id = f"{rid}-encode"
        fut = self.inflight.expect_reply(encode_id, node)
        node.requests.add(encode_id)
        try:
            await self.pool.send(node, EncodeRequest(encode_id, list(images)))
            result = await asyncio.wait_for(fut, ENCODE_TIMEOUT_S)
        except (asyncio.TimeoutError, NodeLost) as exc:
            return self._fallback(rid, node, f"no answer ({type(exc).__name__})")
        finally:
            self.inflight.drop_reply(encode_id, release=True)
            node.requests.discard(encode_id)
        if result.error is not None:
            return self._fallback(rid, node, result.error)
        self.counters["encodes_remote"] += 1
        return result.handovers

    def _fallback(self, rid: str, node: Node, why: str) -> list[EmbeddingHandover]:
        self.counters["encode_fallbacks"] += 1
        log.warning("[%s] encoder node %s: %s; the prefill node encodes the images", rid, node.node_id, why)
        return []
