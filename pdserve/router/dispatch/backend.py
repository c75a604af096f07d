"""What the HTTP layer needs from whatever generates tokens: one async stream per request.

Implementation: pdserve.router.dispatch.cluster.ClusterBackend (router -> prefill node -> decode node
over zmq; with no prefill nodes, whole requests run on decode nodes).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from pdserve.protocol.multimodal import ImageInput
from pdserve.protocol.outputs import StepOutput
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.router.placement.placement import DecodePin


class BackendError(Exception):
    """A generation failed for a reason the client should see (HTTP 503 / 500-class)."""


class GenerationBackend(Protocol):
    model_name: str

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, session: str | None = None, cache_salt: str | None = None,
                 adapter: str | None = None, images: tuple[ImageInput, ...] = (),
                 pin: DecodePin | None = None) -> AsyncIterator[StepOutput]:
        """Yields StepOutput deltas; the last one has finished=True. Raises BackendError.
        session (the OpenAI `user` field) may pin a conversation to a node. cache_salt (the
        request's salt string, pdserve.protocol.cache_salt) and adapter (a LoRA adapter's name)
        enter its block keys' salt: it shares cached KV only with requests naming the same.
        images: a vision-language prompt's (pdserve.protocol.multimodal); their keys enter the
        block keys of the blocks that hold their tokens. pin: a decode node that requests share
        (a beam search's rounds, pdserve.router.placement.placement.DecodePin)."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stops the request on every node that holds it; safe to call twice."""
        ...

    async def health(self) -> dict:
        ...
