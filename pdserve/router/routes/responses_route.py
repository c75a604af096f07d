"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

A response is a chat completion underneath: the request becomes chat messages and fields
(responses_request), `chat_job` renders the template and builds the sampling params (structured
outputs, tools), and the generation runs on the same backend, over prefill and decode nodes.
The chat flavor's deltas are turned into Responses output items and events (responses_events).

`previous_response_id` continues a stored response: its conversation (input and output, not
its instructions) is put before the new input, so the follow-up's prompt starts with the
earlier prompt's tokens and the nodes serve that prefix from their caches.
"""
from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pdserve.router.openai.errors import APIError, as_api_error, bad_request, error_responses
from pdserve.router.openai.jobs import GenerationJob, chat_job
from pdserve.router.openai.responses import ChoiceState
from pdserve.router.openai.responses_events import ResponseEvents, responses_usage
from pdserve.router.openai.responses_request import ResponsesRequest
from pdserve.router.openai.responses_store import ResponseStore, StoredResponse
from pdserve.router.openai.schemas import ChatCompletionRequest
from pdserve.router.openai.streaming import (
    AbortingStreamingResponse,
    ClientDisconnected,
    GenerationGroup,
    run_until_disconnect,
)
from pdserve.router.routes.tenants import request_cache_salt

logger = logging.getLogger(__name__)

_CREATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The response object; with stream=true, server-sent events (`event:` and `data:` "
                         "lines) ending with response.completed, response.incomplete or response.failed",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    **error_responses(400, 401, 404, 413, 429, 500, 503),
}


# Chat fields whose Responses names differ, for the `param` of an error the chat path raises.
_CHAT_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text"}


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"No response found with id '{response_id}'.", "not_found_error", "response_id")


def _param_of(message: str) -> str | None:
    """The request field a translation error names first ("input[2].role ..." -> "input")."""
    match = re.match(r"(input|tools|tool_choice|text)\b", message)
    return match.group(1) if match else None


class _ResponsesRoute:
    def __init__(self, router: Any, store: ResponseStore) -> None:
        self.router = router  # app._Router: tokenizer, backend, chat_job's helpers
        self.store = store

    def _conversation(self, body: ResponsesRequest) -> list[dict[str, Any]]:
        """The stored conversation this request continues, then its own input."""
        earlier: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            stored = self.store.get(body.previous_response_id)
            if stored is None:
                raise APIError(400, f"Previous response with id '{body.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
            earlier = stored.messages
        try:
            return earlier + body.input_messages()
        except ValueError as exc:
            raise bad_request(str(exc), _param_of(str(exc))) from exc

    async def _job(self, body: ResponsesRequest, conversation: list[dict[str, Any]]) -> GenerationJob:
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        try:
            chat = ChatCompletionRequest.model_validate({**body.chat_fields(), "messages": system + conversation})
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise bad_request(f"{where}: {first.get('msg', 'invalid value')}", None) from exc
        except ValueError as exc:
            raise bad_request(str(exc), _param_of(str(exc))) from exc
        try:
            return await chat_job(self.router, chat)
        except APIError as exc:  # the chat path names its own fields; the client sent these
            exc.param = _CHAT_PARAMS.get(exc.param, exc.param)  # type: ignore[arg-type]
            raise

    def _base(self, body: ResponsesRequest, response_id: str) -> dict[str, Any]:
        """The response object's fields that echo the request (as OpenAI's do)."""
        return {"id": response_id, "object": "response", "created_at": int(time.time()),
                "model": self.router.served.resolve(body.model), "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id, "store": body.store is not False,
                "temperature": 1.0 if body.temperature is None else body.temperature,
                "top_p": 1.0 if body.top_p is None else body.top_p,
                "text": body.text or {"format": {"type": "text"}}, "tool_choice": body.tool_choice or "auto",
                "tools": body.tools or [], "truncation": "disabled", "user": body.user, "reasoning": None}

    async def create(self, request: Request, body: ResponsesRequest) -> Response:
        self.router.check_model(body.model)
        conversation = self._conversation(body)
        job = await self._job(body, conversation)
        response_id = f"resp_{uuid.uuid4().hex}"
        logger.info("%s: prompt_tokens=%d max_tokens=%d stream=%s previous=%s", response_id, job.prompt_tokens,
                    job.params[0].max_tokens, bool(body.stream), body.previous_response_id)
        group = GenerationGroup(self.router.backend, response_id, job.choice_prompts[0], job.params,
                                session=body.user, cache_salt=request_cache_salt(request, body.cache_salt),
                                adapter=self.router.served.adapter_for(body.model), images=job.images)
        run = _Run(job, ResponseEvents(self._base(body, response_id)))
        keep = (lambda: self._keep(response_id, run, conversation)) if body.store is not False else (lambda: None)
        headers = {"X-Request-Id": response_id}
        if body.stream:
            return AbortingStreamingResponse(_sse(run.stream(group, keep)), group, headers)
        try:
            await run_until_disconnect(request, lambda: run.collect(group))
        except ClientDisconnected:
            logger.info("%s: client disconnected", response_id)
            return Response(status_code=499)
        finally:
            await group.close()
        keep()
        return JSONResponse(run.events.final, headers=headers)

    def _keep(self, response_id: str, run: _Run, conversation: list[dict[str, Any]]) -> None:
        self.store.put(response_id, StoredResponse(run.events.final, conversation + [run.events.assistant_message()]))


class _Run:
    """One generation's chat deltas, translated as they come."""

    def __init__(self, job: GenerationJob, events: ResponseEvents) -> None:
        self.job = job
        self.events = events
        self.state = ChoiceState(0)

    def _step(self, out: Any) -> list[dict[str, Any]]:
        out = self.job.flavor.shown(out)
        choice = self.job.flavor.chunk_choice(self.state, out)  # before state.add, as the flavors expect
        self.state.add(out)
        return self.events.delta(choice["delta"])

    def _close(self) -> list[dict[str, Any]]:
        return self.events.closing(self.state.finish_reason, responses_usage(self.job.prompt_tokens, self.state))

    async def collect(self, group: GenerationGroup) -> None:
        async for _, out in group.outputs():
            self._step(out)
        self._close()

    async def stream(self, group: GenerationGroup, keep: Any) -> AsyncIterator[dict[str, Any]]:
        for event in self.events.opening():
            yield event
        try:
            async for _, out in group.outputs():
                for event in self._step(out):
                    yield event
        except Exception as exc:
            err = as_api_error(exc)
            logger.warning("%s: stream failed: %s", self.events.base["id"], err.message)
            for event in self.events.failure(err):
                yield event
            return
        closing = self._close()
        keep()  # before the last events go out: a client may send its follow-up as soon as it reads them
        for event in closing:
            yield event


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async for event in events:
        yield f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


def add_responses_routes(app: FastAPI, router: Any, store: ResponseStore | None = None) -> None:
    route = _ResponsesRoute(router, store or ResponseStore())
    app.state.responses_store = route.store

    @app.post("/v1/responses", responses=_CREATE_RESPONSES)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await route.create(request, body)

    @app.get("/v1/responses/{response_id}", responses=error_responses(401, 404, 500))
    async def get_response(response_id: str) -> dict[str, Any]:
        stored = route.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored.body

    @app.delete("/v1/responses/{response_id}", responses=error_responses(401, 404, 500))
    async def delete_response(response_id: str) -> dict[str, Any]:
        if not route.store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
