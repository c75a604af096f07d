"""A node's embedding requests (/v1/embeddings): queued as they arrive, computed between engine
steps on the step thread (one group of prompts per loop turn, so generation keeps moving), and
answered with one EmbedResult each. Prefill and decode nodes both serve them: the router sends
them to prefill nodes, or to decode nodes in the monolithic mode."""
from __future__ import annotations

import logging

import numpy as np

from pdserve.engine.embedding import EmbeddingBatch
from pdserve.wire.messages import EmbedRequest, EmbedResult

log = logging.getLogger(__name__)


class EmbeddingQueue:
    def __init__(self) -> None:
        # request id -> (the router that sent it, the prompts left), in arrival order
        self.jobs: dict[str, tuple[bytes, EmbeddingBatch]] = {}

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def add(self, identity: bytes, msg: EmbedRequest, engine) -> EmbedResult | None:
        """Queue the request; an EmbedResult with the error when it can never be computed here."""
        try:
            batch = EmbeddingBatch(msg.prompts, msg.pooling)
            batch.check(engine)
        except ValueError as exc:
            log.warning("[%s] embedding refused: %s", msg.request_id, exc)
            return EmbedResult(msg.request_id, error=str(exc))
        if msg.request_id in self.jobs:
            return EmbedResult(msg.request_id, error=f"request id {msg.request_id!r} is already in use")
        self.jobs[msg.request_id] = (identity, batch)
        return None

    def abort(self, request_id: str) -> None:
        self.jobs.pop(request_id, None)

    def advance(self, engine) -> list[tuple[bytes, EmbedResult]]:
        """Compute one group of the oldest request's prompts (on the step thread: it runs the
        model); the results of requests that finished, for their routers."""
        rid = next(iter(self.jobs))
        identity, batch = self.jobs[rid]
        try:
            if not batch.advance(engine):
                return []  # no free KV blocks now: after the next step
        except Exception as exc:  # a failed forward fails this request, not the node
            log.exception("[%s] embedding failed", rid)
            del self.jobs[rid]
            return [(identity, EmbedResult(rid, error=f"embedding failed: {exc}"))]
        if not batch.done:
            return []
        del self.jobs[rid]
        vectors = [np.ascontiguousarray(v, dtype="<f4").tobytes() for v in batch.vectors]
        return [(identity, EmbedResult(rid, vectors, sum(len(p) for p in batch.prompts)))]
