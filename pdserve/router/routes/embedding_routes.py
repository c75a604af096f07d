"""POST /v1/embeddings, as OpenAI's: one vector per input, pooled from the served model's final
hidden states (the last token's, or the mean over the tokens) and L2-normalised.

`input` is a text, a list of texts, a token-id list or a list of them. `encoding_format` float
(JSON numbers) or base64 (the little-endian float32 bytes, which the official openai client asks
for by default and decodes). `dimensions` other than the model's hidden size is a 400: a
decoder's hidden state is not trained to be truncated (no Matryoshka loss). The pooling is the
router's --pooling, or the checkpoint's sentence-transformers pooling config, or "last".
"""
from __future__ import annotations

import base64
import json
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote

import numpy as np
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field, WithJsonSchema

from pdserve.router.openai.errors import APIError, bad_request, error_responses
from pdserve.router.openai.schemas import UnicodeCheckedRequest

log = logging.getLogger(__name__)
MAX_INPUTS = 2048  # OpenAI's limit on inputs in one request
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_TEXT = {"type": "string", "minLength": 1}  # inputs() refuses empty texts
_INPUT_SCHEMA = {"anyOf": [_TEXT, _IDS,
                           {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": MAX_INPUTS},
                           {"type": "array", "items": _IDS, "minItems": 1, "maxItems": MAX_INPUTS}],
                 "description": "A text, a list of texts, token ids, or a list of token-id lists"}


@dataclass
class EmbeddingOptions:
    pooling: str = "last"           # "last" | "mean"
    hidden_size: int | None = None  # the vectors' length: the only `dimensions` accepted


def checkpoint_pooling(model_path: Path) -> str | None:
    """The pooling a sentence-transformers checkpoint declares (modules.json's Pooling module),
    when it is one pdserve computes."""
    try:
        modules = json.loads((model_path / "modules.json").read_text())
        folder = next(m["path"] for m in modules if m.get("type", "").endswith("Pooling"))
        config = json.loads((model_path / folder / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError, TypeError):
        return None
    if config.get("pooling_mode_lasttoken"):
        return "last"
    if config.get("pooling_mode_mean_tokens"):
        return "mean"
    return None


class EmbeddingRequest(UnicodeCheckedRequest):
    model_config = ConfigDict(extra="allow")
    input: Annotated[str | list[str] | list[int] | list[list[int]], WithJsonSchema(_INPUT_SCHEMA)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    # Only the model's own size (EmbeddingOptions.hidden_size): the app's document names it.
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str):
            if not value:
                raise ValueError("input must not be an empty string")
            return [value]
        if not value:
            raise ValueError("input must not be empty")
        if not isinstance(value[0], (str, list)):
            return [value]  # type: ignore[list-item]
        if len(value) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs in one request, got {len(value)}")
        if any(item == "" for item in value):
            raise ValueError("input must not contain empty strings")
        return list(value)  # type: ignore[arg-type]


_RESPONSES: dict[int | str, dict[str, Any]] = {**error_responses(400, 401, 404, 413, 429, 500, 503)}


def add_embedding_routes(app: FastAPI, router: Any, options: EmbeddingOptions) -> None:
    """router: the app's _Router (tokenizer, check_model, check_token_ids, backend)."""

    @app.post("/v1/embeddings", responses=_RESPONSES)
    async def embeddings(body: EmbeddingRequest) -> JSONResponse:
        router.check_model(body.model)
        if body.dimensions is not None and body.dimensions != options.hidden_size:
            raise bad_request(f"dimensions is not supported: this model's embeddings have "
                              f"{options.hidden_size or 'a fixed number of'} dimensions", "dimensions")
        prompts = await _token_ids(router, body)
        embed = getattr(router.backend, "embed", None)
        if embed is None:
            raise APIError(404, "this backend serves no embeddings", "not_found_error")
        request_id = f"embd-{uuid.uuid4().hex}"
        log.info("%s: inputs=%d tokens=%d pooling=%s", request_id, len(prompts), sum(map(len, prompts)),
                 options.pooling)
        result = await embed(request_id, prompts, options.pooling)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(raw, body.encoding_format)}
                for i, raw in enumerate(result.vectors)]
        headers = {"X-Request-Id": request_id}
        if body.model_extra:
            headers["X-Ignored-Fields"] = ",".join(sorted(quote(k, safe="") for k in body.model_extra))[:1024]
        return JSONResponse({"object": "list", "data": data, "model": router.served.resolve(body.model),
                             "usage": {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens}},
                            headers=headers)


async def _token_ids(router: Any, body: EmbeddingRequest) -> list[list[int]]:
    try:
        inputs = body.inputs()
    except ValueError as exc:
        raise bad_request(str(exc), "input") from exc
    prompts = []
    for item in inputs:
        ids = await router.encode(item, True) if isinstance(item, str) else list(item)
        router.check_token_ids(ids, "input")
        if len(ids) > router.max_model_len:
            raise APIError(400, f"This model's maximum context length is {router.max_model_len} tokens. "
                           f"However, an input has {len(ids)} tokens.", param="input",
                           code="context_length_exceeded")
        prompts.append(ids)
    return prompts


def _encoded(raw: bytes, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(raw).decode("ascii")
    return np.frombuffer(raw, dtype="<f4").tolist()
