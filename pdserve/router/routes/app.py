"""The router's OpenAI-compatible HTTP layer.

    app = create_app(backend, tokenizer, model_name="m", max_model_len=4096)

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as SSE or not), POST
/v1/responses with GET/DELETE /v1/responses/{id} (responses_route.py), POST /v1/messages and
/v1/messages/count_tokens (Anthropic's Messages API, anthropic_routes.py), POST /v1/embeddings
(embedding_routes.py), GET /v1/models[/{model}] and /version (model_routes.py), GET /health,
GET /metrics; /openapi.json declares every status each answers.
The router tokenizes (and renders chat templates); nodes receive token ids and send back
detokenized, stop-string-checked deltas, which are relayed here.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.models.image_prompts import ImagePrompts
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.router.dispatch.adapters import RouterAdapters
from pdserve.router.dispatch.backend import GenerationBackend
from pdserve.router.openai.beam_job import serve_beams
from pdserve.router.openai.chat_prompt import TOOLS_IGNORED, template_drops_tools
from pdserve.router.openai.errors import (
    SERVER_ERROR,
    APIError,
    ErrorResponse,
    bad_request,
    error_body,
    error_responses,
    install_error_handlers,
    nodes_context_exceeded,
)
from pdserve.router.openai.jobs import GenerationJob, chat_job, completion_job
from pdserve.router.openai.media import MediaInputs
from pdserve.router.openai.media_options import MediaOptions
from pdserve.router.openai.openapi_doc import openapi_document
from pdserve.router.openai.responses import (
    ChoiceState,
    Flavor,
    TokenTexts,
    chunk_body,
    response_body,
    usage,
)
from pdserve.router.openai.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest, HealthReport
from pdserve.router.openai.streaming import (
    AbortingStreamingResponse,
    ClientDisconnected,
    GenerationGroup,
    run_until_disconnect,
    sse_events,
)
from pdserve.router.openai.structured_request import GrammarCheck
from pdserve.router.openai.tool_parsers import parser_for
from pdserve.router.routes.admin_routes import add_admin_routes
from pdserve.router.routes.admission import AdmissionMiddleware
from pdserve.router.routes.anthropic_routes import add_anthropic_routes
from pdserve.router.routes.embedding_routes import EmbeddingOptions, add_embedding_routes
from pdserve.router.routes.lora_routes import add_lora_routes
from pdserve.router.routes.model_routes import ServedModel, add_model_routes
from pdserve.router.routes.responses_route import add_responses_routes
from pdserve.router.routes.tenants import request_cache_salt
from pdserve.router.routes.tokenize_routes import add_tokenize_routes
from pdserve.router.scaling.planner_loop import PlannerLoop
from pdserve.router.scaling.scaler import Scaler

logger = logging.getLogger(__name__)

# Texts longer than this are tokenized in a worker thread so the event loop keeps streaming.
_THREAD_TOKENIZE_CHARS = 16384

# The statuses each route can answer, for the OpenAPI document. Every route: 401 (--api-key
# guards /v1/*, --protect-metrics /health and /metrics) and 500 (the catch-all handler). Only
# POSTs meet the body limit (413) and the in-flight bound (429); only generations reach nodes.
# Not declared: 499, answered to a client already gone, which nobody reads.
_GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The completion; with stream=true, server-sent events ending in "
                         "`data: [DONE]`",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    **error_responses(400, 401, 404, 413, 429, 500, 503),
}
_METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text exposition",
          "content": {"text/plain": {"schema": {"type": "string"}}}},
    **error_responses(401, 404, 500),
}
_HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": HealthReport},
    # The backend's own report (healthy=false: no decode node is up) or the failed check's error.
    503: {"model": HealthReport | ErrorResponse,
          "description": "Unhealthy: the report says healthy=false, or the check itself failed"},
    **error_responses(401, 500),
}


class _Router:
    """State shared by the route handlers."""

    def __init__(self, backend: GenerationBackend, tokenizer: Any, served: ServedModel,
                 tool_call_parser: str | None = None, media: MediaOptions | None = None,
                 image_prompts: ImagePrompts | None = None, eos_token_ids: set[int] | None = None) -> None:
        self.backend = backend
        # Where beams end (beam_job): the engine's EOS ids, else the tokenizer's.
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = set(eos_token_ids) if eos_token_ids is not None else {eos} - {None}
        self.media = MediaInputs(media, image_prompts)  # image parts: checked, and expanded for a VLM
        self.tokenizer = tokenizer
        self.served = served
        self.model_name = served.id
        self.max_model_len = served.max_model_len
        self.vocab_size = len(tokenizer)
        self.texts = TokenTexts(tokenizer)
        # tool_choice "auto": calls are parsed out of the text in the chat template's format.
        self.tool_parser = parser_for(tool_call_parser, getattr(tokenizer, "chat_template", None))
        self.tools_ignored = template_drops_tools(tokenizer)
        if self.tools_ignored:
            logger.warning("the chat template renders no tools: with tools, tool_choice 'auto' will not call "
                           "them (give a template that lists tools with --chat-template)")
        # Added tokens marked special count too: Mistral's [TOOL_CALLS] is one, and the
        # structured-output vocabulary leaves every special token out.
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special_tokens = set(getattr(tokenizer, "all_special_tokens", [])) | {
            t.content for t in added.values() if getattr(t, "special", False)}
        self.grammars = GrammarCheck(tokenizer)  # structured outputs the vocabulary cannot write: 400

    def check_model(self, model: str | None) -> None:
        # Absent model means "the served one" (as vLLM); a name not served is a 404.
        self.served.resolve(model)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) < _THREAD_TOKENIZE_CHARS:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return list(await anyio.to_thread.run_sync(
            lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens)))

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise bad_request("prompt must contain at least one token", param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                              param)

    def resolve_max_tokens(self, requested: int | None, prompt_len: int, param: str) -> int:
        """Default: the rest of the context. Over-long requests are refused (as OpenAI and
        vLLM do) rather than truncated, so clients learn about it."""
        max_tokens = self.max_model_len - prompt_len if requested is None else requested
        if prompt_len >= self.max_model_len or prompt_len + max(max_tokens, 0) > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens. However, you requested {prompt_len + max_tokens} tokens "
                           f"({prompt_len} in the prompt, {max_tokens} in the completion).",
                           param=param, code="context_length_exceeded")
        limit = self.nodes_context()
        if limit is not None and prompt_len >= limit:
            raise nodes_context_exceeded(limit, prompt_len)
        return max_tokens

    def nodes_context(self) -> int | None:
        """The longest request the healthy prefill and decode nodes all take, from their pongs
        (max_model_len, else what their KV cache holds; None before any): a node refuses a prompt
        of that many tokens. Refused here, before a stream's 200 goes out, the prompt is a 400
        streamed or not (the node's own refusal would come as an error event inside the stream)."""
        pool = getattr(self.backend, "pool", None)
        if pool is None:
            return None  # a backend without nodes (tests' fakes)
        block_size = getattr(getattr(self.backend, "block_keys", None), "block_size", 0)
        limits = [n.stats.get("max_model_len") or n.stats.get("total_blocks", 0) * block_size
                  for n in pool.nodes if n.healthy and n.role in ("prefill", "decode")]
        limits = [limit for limit in limits if limit > 0]
        return min(limits) if limits else None

    def build_params(self, body: GenerationRequest, max_tokens: int,
                     logprobs: int | None) -> list[SamplingParams]:
        self.check_sampling_extras(body, max_tokens)
        bad_words = self.bad_words_token_ids(body.bad_words or [])
        try:
            structured = body.structured()
            return [body.sampling_params(max_tokens, logprobs, i, bad_words, structured)
                    for i in range(body.num_choices)]
        except ValueError as exc:  # a ToolsError (tool_choice's grammar) names `tools`
            raise bad_request(str(exc), getattr(exc, "param", None)) from exc

    def check_sampling_extras(self, body: GenerationRequest, max_tokens: int) -> None:
        bad = next((k for k in body.logit_bias or {} if int(k) >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"logit_bias key {bad} is outside the vocabulary [0, {self.vocab_size})",
                              "logit_bias")
        if body.min_tokens and body.min_tokens > max_tokens:
            raise bad_request(f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens})",
                              "min_tokens")

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word as tokenized alone and after a space (as vLLM does), so both spellings
        of it in running text are barred."""
        out: list[list[int]] = []
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if not ids:
                    raise bad_request(f"bad word {word!r} has no tokens", "bad_words")
                if ids not in out:
                    out.append(ids)
        return out

    async def serve(self, request: Request, body: GenerationRequest, job: GenerationJob, prefix: str) -> Response:
        if body.use_beam_search:
            if job.images:
                raise bad_request("use_beam_search takes text prompts only", "use_beam_search")
            kw = {"session": body.user, "cache_salt": request_cache_salt(request, body.cache_salt),
                  "adapter": self.served.adapter_for(body.model)}
            return await serve_beams(self, request, body, job, prefix, kw)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        params, flavor = job.params, job.flavor
        logger.info("%s: prompt_tokens=%d choices=%d max_tokens=%d stream=%s", request_id,
                    job.max_prompt_tokens, len(params), params[0].max_tokens, bool(body.stream))
        default_targets = getattr(self.backend, "targets", None)  # only backends that place prompts
        group = GenerationGroup(self.backend, request_id, job.choice_prompts[0], params, session=body.user,
                                choice_prompts=job.choice_prompts, targets=body.targets(default_targets),
                                cache_salt=request_cache_salt(request, body.cache_salt),
                                adapter=self.served.adapter_for(body.model), images=job.images)
        model = self.served.resolve(body.model)  # the name asked for, as vLLM answers
        headers = {"X-Request-Id": request_id}
        if body.ignored_fields:  # accepted but not acted on: the client can see what was dropped
            headers["X-Ignored-Fields"] = ",".join(body.ignored_fields)[:1024]
        if self.tools_ignored and getattr(body, "tools", None) and getattr(body, "tool_choice", None) != "none":
            headers["X-Tools-Ignored"] = TOOLS_IGNORED  # the prompt lacks them: the model cannot know of them
        created = int(time.time())
        if body.stream:
            chunks = self.stream_chunks(group, flavor, (request_id, created, model), body.include_usage,
                                        job.prompt_tokens)
            return AbortingStreamingResponse(sse_events(chunks), group, headers)
        return await self.collect(request, group, flavor, (request_id, created, model), headers, job.prompt_tokens)

    async def stream_chunks(self, group: GenerationGroup, flavor: Flavor, ident: tuple[str, int, str],
                            include_usage: bool, prompt_tokens: int) -> AsyncIterator[dict[str, Any]]:
        """ident: the response's (id, created, model)."""
        states = [ChoiceState(i) for i in range(len(group.params))]
        for choice in flavor.opening_choices(len(states)):
            yield chunk_body(flavor, *ident, [choice])
        async for index, shown in group.outputs():
            out = flavor.shown(shown)
            state = states[index]
            choice = flavor.chunk_choice(state, out)
            state.add(out)
            # Empty deltas (text held back while a stop string may be forming) are skipped.
            if out.new_text or out.new_token_ids or out.finished:
                yield chunk_body(flavor, *ident, [choice])
        if include_usage:
            yield chunk_body(flavor, *ident, [], usage(prompt_tokens, states))

    async def collect(self, request: Request, group: GenerationGroup, flavor: Flavor,
                      ident: tuple[str, int, str], headers: dict[str, str], prompt_tokens: int) -> Response:
        states = [ChoiceState(i) for i in range(len(group.params))]

        async def consume() -> None:
            async for index, out in group.outputs():
                states[index].add(flavor.shown(out))

        try:
            await run_until_disconnect(request, consume)
        except ClientDisconnected:
            logger.info("%s: client disconnected", ident[0])
            return Response(status_code=499)  # nobody reads it; nginx's "client closed"
        finally:
            await group.close()
        body = response_body(flavor, *ident, states, prompt_tokens)
        return JSONResponse(body, headers=headers)


def _add_openai_routes(app: FastAPI, router: _Router) -> None:
    @app.post("/v1/completions", responses=_GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        router.check_model(body.model)
        return await router.serve(request, body, await completion_job(router, body), "cmpl")

    @app.post("/v1/chat/completions", responses=_GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        router.check_model(body.model)
        return await router.serve(request, body, await chat_job(router, body), "chatcmpl")


def _add_info_routes(app: FastAPI, router: _Router) -> None:
    # response_class=Response: no JSON 200 in the document, and errors stay application/json.
    @app.get("/metrics", response_class=Response, responses=_METRICS_RESPONSES)
    async def metrics() -> Response:
        registry = getattr(router.backend, "metrics", None)
        if registry is None:
            raise APIError(404, "this backend exports no metrics", "not_found_error")
        return Response(registry.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/health", responses=_HEALTH_RESPONSES)
    async def health() -> Response:
        try:
            info = await router.backend.health()
        except Exception as exc:
            logger.warning("health check failed: %s", exc)
            return JSONResponse(error_body(f"backend unhealthy: {exc}", SERVER_ERROR, None,
                                           "service_unavailable"), status_code=503)
        # A backend may report {"healthy": False} (e.g. no nodes registered) without raising.
        status = 503 if isinstance(info, dict) and info.get("healthy") is False else 200
        return JSONResponse(info, status_code=status)


def create_app(backend: GenerationBackend, tokenizer: Any, model_name: str,
               max_model_len: int, admission: dict[str, Any] | None = None,
               tool_call_parser: str | None = None, served_model_names: list[str] | None = None,
               model_root: str | None = None, embedding: EmbeddingOptions | None = None,
               scaler: Scaler | None = None, planner: PlannerLoop | None = None,
               media: MediaOptions | None = None, image_prompts: ImagePrompts | None = None,
               eos_token_ids: set[int] | None = None) -> FastAPI:
    """admission: AdmissionMiddleware's options (api_key, protect_metrics, max_body_bytes,
    max_queued_requests). tool_call_parser: the tool-call format of tool_choice "auto"
    (tool_parsers.PARSERS; default: the chat template's). served_model_names: the names a
    request may use (default: model_name); model_root: the tokenizer's directory, for /v1/models.
    embedding: /v1/embeddings' pooling and vector size. scaler, planner: the cluster's scaling
    (admin_routes), None where the backend cannot be scaled. media: the limits on image inputs
    (media.py's MediaOptions); image_prompts: a vision-language model's image processing (None:
    the model takes no images). eos_token_ids: the model's (beam search ends beams on them;
    default: the tokenizer's)."""
    app = FastAPI(title="pdserve router")
    app.add_middleware(AdmissionMiddleware, metrics=getattr(backend, "metrics", None), **(admission or {}))
    install_error_handlers(app)
    served = ServedModel(served_model_names or [model_name], model_root or model_name, max_model_len,
                         int(time.time()), getattr(backend, "adapters", None) or RouterAdapters())
    router = _Router(backend, tokenizer, served, tool_call_parser, media, image_prompts, eos_token_ids)
    _add_openai_routes(app, router)
    add_responses_routes(app, router)
    add_anthropic_routes(app, router)
    add_model_routes(app, served)
    _add_info_routes(app, router)
    add_tokenize_routes(app, router)
    add_embedding_routes(app, router, embedding or EmbeddingOptions())
    add_admin_routes(app, scaler, planner)
    add_lora_routes(app, served)
    app.state.router = router
    embedding_size = (embedding or EmbeddingOptions()).hidden_size
    app.openapi = lambda: openapi_document(app, router.vocab_size, embedding_size)  # type: ignore[method-assign]
    return app
