"""Running the n generations of one request, streaming them as SSE, and aborting on disconnect.

Abort contract: every backend request that was started and has not finished is aborted when
the HTTP exchange ends for any reason other than completion (client gone, handler cancelled,
error). `GenerationGroup.close()` does it and is always reached from a `finally`:
  * streaming: `AbortingStreamingResponse.__call__` wraps Starlette's response. Under uvicorn
    Starlette watches for `http.disconnect` and cancels the body iterator; our finally then runs.
  * non-streaming: `run_until_disconnect` races the collection against `http.disconnect`.
Cleanup runs in a shielded anyio scope: Starlette cancels with level-triggered anyio scopes,
so an unshielded `await backend.abort(...)` inside a cancelled scope would itself be cancelled.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.protocol.outputs import StepOutput
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.router.dispatch.backend import BackendError, GenerationBackend
from pdserve.router.openai.errors import as_api_error

logger = logging.getLogger(__name__)

CLEANUP_TIMEOUT_S = 10.0
T = TypeVar("T")

# Queue items: (choice index, output or None when that choice's stream ended, error or None).
_Item = tuple[int, StepOutput | None, BaseException | None]


class ClientDisconnected(Exception):
    pass


class GenerationGroup:
    """The backend streams of one HTTP request (n per prompt), merged into one stream of
    (index, output). choice_prompts: each choice's prompt, for a batch of prompts; without it
    every choice continues prompt_ids. cache_salt, adapter: what keys the request's KV blocks
    apart from other requests' (backend.generate's)."""

    def __init__(self, backend: GenerationBackend, base_id: str, prompt_ids: list[int],
                 params: list[SamplingParams], session: str | None = None,
                 choice_prompts: list[list[int]] | None = None, targets=None, cache_salt: str | None = None,
                 adapter: str | None = None, images: tuple = ()) -> None:
        self.backend = backend
        self.images = images  # a vision-language prompt's ImageInputs (every choice shares the prompt)
        self.session = session
        self.targets = targets  # the request's own TTFT/ITL targets (pd_decision.Targets), if any
        self.cache_salt, self.adapter = cache_salt, adapter
        self.prompt_ids = prompt_ids
        self.params = params
        self.choice_prompts = choice_prompts or [prompt_ids] * len(params)
        self.request_ids = [f"{base_id}-{i}" for i in range(len(params))]
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._unfinished: set[str] = set()

    def start(self) -> None:
        if self._tasks:
            return
        for index, (rid, params) in enumerate(zip(self.request_ids, self.params)):
            self._unfinished.add(rid)
            self._tasks.append(asyncio.create_task(self._pump(index, rid, params)))

    async def _pump(self, index: int, rid: str, params: SamplingParams) -> None:
        try:
            await self._consume(index, rid, params)
            self._queue.put_nowait((index, None, None))
        except Exception as exc:  # forwarded to the consumer, which maps it to an HTTP error
            self._queue.put_nowait((index, None, exc))

    async def _consume(self, index: int, rid: str, params: SamplingParams) -> None:
        extra = {"targets": self.targets} if self.targets is not None else {}  # only backends that place prompts
        if self.images:
            extra["images"] = self.images  # only backends that serve a vision-language model
        stream = self.backend.generate(rid, self.choice_prompts[index], params, session=self.session,
                                       cache_salt=self.cache_salt, adapter=self.adapter, **extra)
        closer = getattr(stream, "aclose", None)
        async with contextlib.AsyncExitStack() as stack:
            if closer is not None:
                stack.push_async_callback(closer)
            async for out in stream:
                if out.finish_reason == "error" or out.error:
                    raise BackendError(out.error or "generation failed")
                self._queue.put_nowait((index, out, None))
                if out.finished:
                    self._unfinished.discard(rid)
                    return
        # A stream that ends without finished=True would leave the client waiting forever.
        raise BackendError(f"backend stream for {rid} ended before the request finished")

    async def outputs(self) -> AsyncIterator[tuple[int, StepOutput]]:
        """Yields outputs as they come; raises the first error any choice hit."""
        self.start()
        remaining = len(self._tasks)
        while remaining:
            index, out, err = await self._queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield index, out

    async def close(self) -> None:
        """Stops the pumps and aborts every started request that has not finished."""
        if not self._unfinished and all(task.done() for task in self._tasks):
            return  # the common case: every choice finished; nothing to cancel or abort
        with anyio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for rid in sorted(self._unfinished):
                await self._abort(rid)
            self._unfinished.clear()

    async def _abort(self, rid: str) -> None:
        logger.info("aborting %s", rid)
        try:
            await self.backend.abort(rid)
        except Exception:  # abort is best effort; the node also times requests out
            logger.warning("abort of %s failed", rid, exc_info=True)


def sse(payload: dict[str, Any] | str) -> str:
    # allow_nan=False: a NaN or infinity would be sent as a literal no JSON parser takes.
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), allow_nan=False)
    return f"data: {data}\n\n"


async def sse_events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """SSE framing; an error ends the stream with an error chunk and [DONE], never a hang."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except Exception as exc:
        err = as_api_error(exc)
        logger.warning("stream failed: %s", err.message)
        yield sse(err.body())
    yield sse("[DONE]")


class AbortingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its generation group when it stops."""

    def __init__(self, content: AsyncIterator[str], group: GenerationGroup,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.group.close()


async def _wait_for_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message can only be http.disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Runs `work` unless the client goes away first (then raises ClientDisconnected)."""
    work_task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
    if work_task in done:
        return work_task.result()
    raise ClientDisconnected()
