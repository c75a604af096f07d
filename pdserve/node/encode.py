"""`pdserve encode`: an encoder node (E/P/D). It runs a vision-language model's vision tower
only: for each EncodeRequest it encodes the images (its encoder cache keeps them by hash, so the
router's hash affinity makes a repeated image a hit) and puts their embeddings in the store's
Redis (pdserve.kvstore.embedding_store), where the prefill node loads them instead of encoding.
The engine is built as any node's (it holds the tower); it never runs a language-model step.
"""
from __future__ import annotations

import logging

from pdserve.engine.engine import LLMEngine
from pdserve.node.runtime import NodeRuntime
from pdserve.wire.messages import EncodeRequest, EncodeResult, Message

log = logging.getLogger(__name__)


class EncodeNode(NodeRuntime):
    role = "encode"

    def __init__(self, engine: LLMEngine, bind, node_id: str):
        if engine.runner.multimodal is None:
            raise ValueError(f"{engine.config.model} takes no images: an encoder node needs a vision-language model")
        if self.embedding_store is None:
            raise ValueError("an encoder node hands embeddings over through the store: give it --store redis://...")
        super().__init__(engine, bind, node_id)
        self.queue: list[tuple[bytes, EncodeRequest]] = []

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

    def _encode(self, msg: EncodeRequest) -> EncodeResult:
        """On the step thread (the model's thread pool)."""
        mm, store = self.engine.runner.multimodal, self.embedding_store
        try:
            for image in msg.images:
                embeddings = mm.cache.get(image, mm.model.encode_image)
                written = store.put(store.key(self.engine.salt, image.content_hash), embeddings)
                if not written:
                    return EncodeResult(msg.request_id, error=f"the store ({store.url}) refused the embeddings")
                self.stats.embedding_bytes_store += written
        except Exception as exc:  # a bad image fails its request, not the node
            log.exception("[%s] encoding failed", msg.request_id)
            return EncodeResult(msg.request_id, error=f"{type(exc).__name__}: {exc}")
        return EncodeResult(msg.request_id, [image.content_hash for image in msg.images])

    def idle(self) -> bool:
        return not self.queue and super().idle()
