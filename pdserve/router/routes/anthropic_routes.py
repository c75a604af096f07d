"""POST /v1/messages (Anthropic's Messages API) and POST /v1/messages/count_tokens.

A message is a chat completion underneath: the body becomes a chat request (anthropic/request.py),
`chat_job` renders the template and builds the sampling params (tools, structured outputs), and
the generation runs on the same backend, over prefill and decode nodes. The chat flavor's deltas
become content blocks and Anthropic's events (anthropic/events.py). Errors on these paths answer
in Anthropic's shape (anthropic/errors.py), with the same statuses as the OpenAI routes.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pdserve.router.anthropic.errors import anthropic_error, anthropic_error_responses, error_type
from pdserve.router.anthropic.events import MessageEvents, messages_usage
from pdserve.router.anthropic.request import ConversationRequest, MessagesRequest
from pdserve.router.openai.errors import APIError, add_error_shape, as_api_error, bad_request
from pdserve.router.openai.jobs import GenerationJob, chat_job, chat_prompt
from pdserve.router.openai.responses import ChoiceState
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
    200: {"description": "The message; with stream=true, server-sent events (`event:` and `data:` lines) "
                         "from message_start to message_stop",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    **anthropic_error_responses(400, 401, 404, 413, 429, 500, 503),
}
# Chat fields whose Messages names differ, for the `param` of an error the chat path raises.
_CHAT_PARAMS = {"stop": "stop_sequences", "user": "metadata.user_id", "response_format": "output_config"}


def _param_of(message: str) -> str | None:
    """The request field a translation error names first ("messages[2].content ..." -> "messages")."""
    match = re.match(r"(messages|system|tools|tool_choice|output_config)\b", message)
    return match.group(1) if match else None


def _chat_request(body: ConversationRequest, **overrides: Any) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate({**body.chat_fields(), **overrides})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise bad_request(f"{where}: {str(first.get('msg', 'invalid value')).removeprefix('Value error, ')}",
                          None) from exc
    except ValueError as exc:
        raise bad_request(str(exc), _param_of(str(exc))) from exc


def _stop_sequence(router: Any, state: ChoiceState, stops: list[str], stop_ids: set[int]) -> str | None:
    """The stop sequence that ended the answer, if one did: the nodes report only "stop", so the
    output's tokens are decoded whole, and the first sequence in them is the one that matched
    (an answer that ended on an end-of-sequence token ended on none)."""
    if state.finish_reason != "stop" or not stops or not state.token_ids or state.token_ids[-1] in stop_ids:
        return None
    full = router.tokenizer.decode(state.token_ids, skip_special_tokens=True)
    found = sorted((full.find(s), -len(s), s) for s in stops if s in full)
    return found[0][2] if found else None


class _Run:
    """One generation's chat deltas, translated as they come."""

    def __init__(self, router: Any, job: GenerationJob, events: MessageEvents, stops: list[str]) -> None:
        self.router, self.job, self.events, self.stops = router, job, events, stops
        self.state = ChoiceState(0)

    def _usage(self) -> dict[str, Any]:
        return messages_usage(self.job.prompt_tokens, self.state.num_cached_tokens, len(self.state.token_ids))

    def _step(self, out: Any) -> list[dict[str, Any]]:
        out = self.job.flavor.shown(out)
        choice = self.job.flavor.chunk_choice(self.state, out)  # before state.add, as the flavors expect
        self.state.add(out)
        return self.events.start(self._usage()) + self.events.delta(choice["delta"])

    def _ending(self) -> tuple[str, str | None]:
        stop_ids = set(self.router.eos_token_ids) | set(self.job.params[0].stop_token_ids or ())
        sequence = _stop_sequence(self.router, self.state, self.stops, stop_ids)
        return self.events.stop_reason(self.state.finish_reason, sequence), sequence

    async def collect(self, group: GenerationGroup) -> dict[str, Any]:
        async for _, out in group.outputs():
            self._step(out)
        return self.events.message(*self._ending(), self._usage())

    async def stream(self, group: GenerationGroup) -> AsyncIterator[dict[str, Any]]:
        try:
            async for _, out in group.outputs():
                for event in self._step(out):
                    yield event
        except Exception as exc:
            err = as_api_error(exc)
            logger.warning("%s: stream failed: %s", self.events.base["id"], err.message)
            yield {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}
            return
        usage = self._usage()
        for event in self.events.start(usage) + self.events.closing(*self._ending(), usage):
            yield event


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async for event in events:
        yield f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'), allow_nan=False)}\n\n"


async def _job(router: Any, body: MessagesRequest) -> tuple[ChatCompletionRequest, GenerationJob]:
    chat = _chat_request(body)
    try:
        return chat, await chat_job(router, chat, _prefill(body))
    except APIError as exc:  # the chat path names its own fields; the client sent these
        exc.param = _CHAT_PARAMS.get(exc.param, exc.param)  # type: ignore[arg-type]
        raise


async def create_message(router: Any, request: Request, body: MessagesRequest) -> Response:
    router.check_model(body.model)
    chat, job = await _job(router, body)
    message_id = f"msg_{uuid.uuid4().hex}"
    logger.info("%s: prompt_tokens=%d max_tokens=%d stream=%s", message_id, job.prompt_tokens,
                job.params[0].max_tokens, bool(body.stream))
    group = GenerationGroup(router.backend, message_id, job.choice_prompts[0], job.params, session=chat.user,
                            cache_salt=request_cache_salt(request, chat.cache_salt),
                            adapter=router.served.adapter_for(body.model), images=job.images)
    run = _Run(router, job, MessageEvents({"id": message_id, "model": router.served.resolve(body.model)}),
               body.stop_sequences or [])
    headers = {"X-Request-Id": message_id, "request-id": message_id}  # the anthropic SDK's _request_id
    if body.ignored_fields:
        headers["X-Ignored-Fields"] = ",".join(body.ignored_fields)[:1024]
    if body.stream:
        return AbortingStreamingResponse(_sse(run.stream(group)), group, headers)
    try:
        message = await run_until_disconnect(request, lambda: run.collect(group))
    except ClientDisconnected:
        logger.info("%s: client disconnected", message_id)
        return Response(status_code=499)
    finally:
        await group.close()
    return JSONResponse(message, headers=headers)


async def count_tokens(router: Any, body: ConversationRequest) -> dict[str, Any]:
    """The prompt's tokens as /v1/messages would count them (the template rendered with the tools)."""
    router.check_model(body.model)
    _, ids, _ = await chat_prompt(router, _chat_request(body), _prefill(body))
    return {"input_tokens": len(ids)}


def _prefill(body: ConversationRequest) -> str:
    try:
        return body.prefill()
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc


def add_anthropic_routes(app: FastAPI, router: Any) -> None:
    add_error_shape(app, "/v1/messages", anthropic_error)

    @app.post("/v1/messages", responses=_CREATE_RESPONSES)
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await create_message(router, request, body)

    @app.post("/v1/messages/count_tokens", responses=anthropic_error_responses(400, 401, 404, 413, 429, 500))
    async def messages_count_tokens(body: ConversationRequest) -> dict[str, Any]:
        return await count_tokens(router, body)
