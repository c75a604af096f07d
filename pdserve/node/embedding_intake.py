"""Where a node's image embeddings come from before its engine would encode them (E/P/D): an
encoder node's arena over NIXL (the request names each image's blocks), else the store's Redis,
keyed by the image hash. What arrives goes into the engine's encoder cache; an image that arrives
from neither is the engine's to encode, with the same output.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import zmq

from pdserve.engine.engine import LLMEngine
from pdserve.kvstore.embedding_nixl import EmbeddingFetcher, block_nbytes
from pdserve.node.pullers import fetch_peer_metadata
from pdserve.protocol.multimodal import ImageInput
from pdserve.wire.embedding_handover import EmbeddingHandover

if TYPE_CHECKING:  # an annotation only: redis-py, which a node without a store never imports (0.1 s of CPU)
    from pdserve.kvstore.embedding_store import EmbeddingStore

log = logging.getLogger(__name__)
READ_TIMEOUT_S = 2.0  # an image's READ takes a millisecond; past this the node encodes it


class EmbeddingIntake:
    def __init__(self, node_id: str, engine: LLMEngine, ctx: zmq.Context, store: EmbeddingStore | None, stats):
        self.node_id, self.engine, self.ctx, self.store, self.stats = node_id, engine, ctx, store, stats
        self.fetcher: EmbeddingFetcher | None = None  # built at the first NIXL handover
        self.peers: dict[str, str] = {}  # side channel -> the encoder agent's name

    def take(self, images: Sequence[ImageInput], handovers: Sequence[EmbeddingHandover] = ()) -> None:
        mm = self.engine.runner.multimodal
        if mm is None:
            return
        by_hash = {h.content_hash: h for h in handovers}
        received_at = time.monotonic()
        for image in images:
            if image.content_hash in mm.cache or image.length > mm.cache.budget:
                continue  # (an image over the encoder cache's budget could not be kept: the engine encodes it)
            handover = by_hash.get(image.content_hash)
            embeddings = self._read(handover, image, received_at) if handover is not None else None
            if embeddings is None:
                embeddings = self._load(image)
            if embeddings is not None:
                mm.cache.put(image.content_hash, embeddings.to(self.engine.device, self.engine.dtype))
                self.stats.embeddings_loaded += 1

    def _load(self, image: ImageInput):
        if self.store is None:
            return None
        found = self.store.get(self.store.key(self.engine.salt, image.content_hash))
        if found is None or found[0].shape[0] != image.length:
            return None
        self.stats.embedding_bytes_store += found[1]
        return found[0]

    def _read(self, handover: EmbeddingHandover, image: ImageInput, received_at: float):
        """The image's embeddings READ from the encoder node's arena, or None."""
        left = received_at + handover.lease_s - time.monotonic()
        if handover.rows != image.length or left <= 0:
            return None
        try:
            fetcher = self._fetcher()
            peer = self._peer(fetcher, handover)
        except Exception as exc:  # no agent here, or the encoder node's unreachable: the engine encodes
            log.warning("no NIXL READ from encoder agent %s: %s", handover.agent_name, exc)
            self.peers.pop(handover.side_channel, None)
            return None
        t0 = time.perf_counter()
        embeddings = fetcher.fetch(peer, handover.regions, handover.digests, handover.rows,
                                   handover.lease_id.encode(), min(left, READ_TIMEOUT_S))
        if embeddings is None:
            self.peers.pop(handover.side_channel, None)  # the encoder node may have restarted
            return None
        self.stats.embedding_bytes_nixl += len(handover.regions) * fetcher.arena.block_nbytes
        self.stats.embedding_us_nixl += int((time.perf_counter() - t0) * 1e6)
        return embeddings

    def _fetcher(self) -> EmbeddingFetcher:
        if self.fetcher is None:
            mm, config = self.engine.runner.multimodal, self.engine.config
            self.fetcher = EmbeddingFetcher(f"{self.node_id}-embeddings", config.encoder_cache_tokens,
                                            mm.model.spec.hidden_size, self.engine.dtype)
        return self.fetcher

    def _peer(self, fetcher: EmbeddingFetcher, handover: EmbeddingHandover) -> str:
        """The encoder agent's name, after the handshake (same model and block layout, else refused)."""
        if handover.side_channel not in self.peers:
            mm = self.engine.runner.multimodal
            reply = fetch_peer_metadata(self.ctx, handover.side_channel, self.engine.salt,
                                        block_nbytes(mm.model.spec.hidden_size, self.engine.dtype))
            name = fetcher.arena.agent.add_peer(reply.metadata, handover.agent_name)
            fetcher.arena.agent.make_connection(name)
            self.peers[handover.side_channel] = name
        return self.peers[handover.side_channel]

    @property
    def integrity_failures(self) -> int:
        return self.fetcher.integrity_failures if self.fetcher is not None else 0

    def close(self) -> None:
        if self.fetcher is not None:
            self.fetcher.close()
            self.fetcher = None
