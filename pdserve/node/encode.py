"""`pdserve encode`: an encoder node (E/P/D). It runs a vision-language model's vision tower
only: for each EncodeRequest it encodes the images (its encoder cache keeps them by hash, so the
router's hash affinity makes a repeated image a hit) and hands their embeddings over, the prefill
node then taking them instead of encoding:
- over NIXL (given --nixl-side-channel): they wait in a registered arena, pinned for the prefill
  node's READ (pdserve.kvstore.embedding_nixl); the result says where, and the router passes that
  on in the PrefillRequest;
- else through the store's Redis (pdserve.kvstore.embedding_store), under the image hash.
The engine is built as any node's (it holds the tower); it never runs a language-model step.
"""
from __future__ import annotations

import logging

from pdserve.engine.engine import LLMEngine
from pdserve.kvstore.embedding_nixl import EmbeddingPublisher
from pdserve.node.metadata_server import MetadataServer
from pdserve.node.producers import advertised
from pdserve.node.runtime import NodeRuntime
from pdserve.wire.embedding_handover import EmbeddingHandover
from pdserve.wire.handover import NixlMetadata
from pdserve.wire.messages import EncodeRequest, EncodeResult, Message
from pdserve.wire.transport import NodeSocket

log = logging.getLogger(__name__)


class EncodeNode(NodeRuntime):
    role = "encode"

    def __init__(self, engine: LLMEngine, bind, node_id: str, nixl_side_channel: str | None = None,
                 lease_s: float = 30.0, advertise_host: str | None = None):
        mm = engine.runner.multimodal
        if mm is None:
            raise ValueError(f"{engine.config.model} takes no images: an encoder node needs a vision-language model")
        if self.embedding_store is None and not nixl_side_channel:
            raise ValueError("an encoder node hands embeddings over by NIXL or the store: give it "
                             "--nixl-side-channel tcp://host:port or --store redis://...")
        super().__init__(engine, bind, node_id)
        self.queue: list[tuple[bytes, EncodeRequest]] = []
        self.nixl: EmbeddingPublisher | None = None
        if nixl_side_channel:
            self.nixl = EmbeddingPublisher(f"{node_id}-embeddings", engine.config.encoder_cache_tokens,
                                           mm.model.spec.hidden_size, engine.dtype, lease_s)
            side = NodeSocket(self.ctx, nixl_side_channel)  # bound now: a taken port fails the node's start
            self.side_channel = advertised(nixl_side_channel, advertise_host)
            arena = self.nixl.arena
            # the handshake, off the node's loop (as a prefill node's: node/metadata_server.py), so a
            # reader's first READ never waits for an encoder step
            self.side = MetadataServer(side, NixlMetadata(arena.agent.name, arena.agent.metadata(),
                                                          kv_salt=engine.salt, block_nbytes=arena.block_nbytes))

    def handle(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, EncodeRequest):
            self.queue.append((identity, msg))
            self.stats.requests_total += 1
        else:
            log.warning("encoder node ignores %s", type(msg).__name__)

    def run_once(self) -> None:
        super().run_once()
        if self.queue:
            work, self.queue = self.queue, []
            for identity, result in self._run_answering_pings(lambda: [(i, self._encode(m)) for i, m in work]):
                self.control.send(identity, result)

    def poll_background(self) -> None:
        if self.nixl is not None:
            self.nixl.poll()

    def _encode(self, msg: EncodeRequest) -> EncodeResult:
        """On the step thread (the model's thread pool)."""
        mm = self.engine.runner.multimodal
        handovers: list[EmbeddingHandover] = []
        try:
            for image in msg.images:
                embeddings = mm.cache.get(image, mm.model.encode_image)
                error = (self._pin(msg.request_id, image.content_hash, embeddings, handovers) if self.nixl
                         else self._put(image.content_hash, embeddings))
                if error is not None:
                    return EncodeResult(msg.request_id, error=error)
        except Exception as exc:  # a bad image fails its request, not the node
            log.exception("[%s] encoding failed", msg.request_id)
            return EncodeResult(msg.request_id, error=f"{type(exc).__name__}: {exc}")
        if self.nixl is not None:
            return EncodeResult(msg.request_id, handovers=handovers)
        return EncodeResult(msg.request_id, [image.content_hash for image in msg.images])

    def _put(self, content_hash: str, embeddings) -> str | None:
        store = self.embedding_store
        written = store.put(store.key(self.engine.salt, content_hash), embeddings)
        if not written:
            return f"the store ({store.url}) refused the embeddings"
        self.stats.embedding_bytes_store += written
        return None

    def _pin(self, request_id: str, content_hash: str, embeddings, out: list[EmbeddingHandover]) -> str | None:
        lease_id = f"{request_id}|{content_hash}"
        entry = self.nixl.publish(content_hash, embeddings, lease_id)
        if entry is None:
            return "the embedding arena is full of pinned images"
        arena = self.nixl.arena
        out.append(EmbeddingHandover(content_hash, entry.rows, arena.agent.name, self.side_channel,
                                     arena.agent.block_regions(entry.block_ids), entry.digests, lease_id,
                                     self.nixl.lease_s))
        self.stats.embedding_bytes_nixl += len(entry.block_ids) * arena.block_nbytes
        return None

    def pong(self, ping):
        pong = super().pong(ping)
        if self.nixl is not None:
            pong.stats.update(embedding_leases_expired=self.nixl.leases_expired,
                              embedding_arena_free_blocks=len(self.nixl.arena.free))
        return pong

    def idle(self) -> bool:
        return not self.queue and super().idle()

    def close_role(self) -> None:
        if self.nixl is not None:
            self.side.close()
            self.nixl.close()
