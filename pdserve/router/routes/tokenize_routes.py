"""vLLM's /tokenize and /detokenize: the router's own tokenizer, no node involved.

Shapes follow vLLM's protocol: /tokenize takes a completion prompt or chat messages and answers
{count, max_model_len, tokens[, token_strs]}; /detokenize takes {tokens} and answers {prompt}.
Like vLLM's --api-key, the API key guards /v1/* only.
"""
from __future__ import annotations

from typing import Any, Protocol

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from pdserve.router.openai.chat_message import ChatMessage
from pdserve.router.openai.chat_prompt import render_chat_prompt
from pdserve.router.openai.errors import bad_request, error_responses
from pdserve.router.openai.media import MediaInputs


class TokenizingRouter(Protocol):
    """What these routes use of the router's state (pdserve.router.routes.app's _Router)."""
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    model_name: str
    media: MediaInputs

    def check_model(self, model: str | None) -> None: ...

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...


# Exactly one of prompt and messages (null counts as absent), as _tokenize enforces.
_ONE_OF_PROMPT_MESSAGES = {"oneOf": [
    {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
    {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]}


class TokenizeRequest(BaseModel):
    """Either `prompt` (completion style) or `messages` (chat style, rendered by the template)."""
    model_config = ConfigDict(extra="allow", json_schema_extra=_ONE_OF_PROMPT_MESSAGES)
    model: str | None = None
    prompt: str | None = None
    # A chat template renders no empty conversation.
    messages: list[ChatMessage] | None = Field(None, json_schema_extra={"minItems": 1})
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    prompt: str


_RESPONSES = error_responses(400, 404, 413, 500)


def add_tokenize_routes(app: FastAPI, router: TokenizingRouter) -> None:
    @app.post("/tokenize", response_model=TokenizeResponse, responses=_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        router.check_model(body.model)
        ids = await _tokenize(router, body)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": router.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = router.tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        router.check_model(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < router.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {router.vocab_size})", "tokens")
        return {"prompt": router.tokenizer.decode(body.tokens)}


async def _tokenize(router: TokenizingRouter, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return await router.encode(body.prompt, add_special)
    messages = body.messages or []
    refs = [ref for i, m in enumerate(messages) for ref in m.image_refs(i)]
    checked = await router.media.check(refs, body.model or router.model_name)  # as the chat route checks them
    text, template_special = render_chat_prompt(router.tokenizer, [
        {"role": m.role, "content": m.template_parts() if checked and m.image_refs(0) else m.text()}
        for m in messages], None, add_generation_prompt=body.add_generation_prompt)
    add_special = template_special if body.add_special_tokens is None else body.add_special_tokens
    ids, _ = await router.media.expand(await router.encode(text, add_special), checked)  # image tokens counted
    return ids

