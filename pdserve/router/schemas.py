"""Request models for the OpenAI-compatible endpoints (pydantic lives only at this HTTP edge).

Unknown fields are tolerated (extra="allow") so clients that send newer OpenAI fields keep
working; each request's ignored fields are logged, as vLLM does. Fields the engine cannot
honour are rejected with 400 rather than silently ignored, because a silently ignored knob
yields outputs the client did not ask for:
  * echo=true with logprobs (prompt logprobs are not computed), suffix, best_of != n: rejected.
  * tool_choice "auto" / "required": rejected (a named function, or "none", is supported).
  * a batch of prompts (more than one) in /v1/completions: rejected; send one per request.
Those knobs keep their validators (for the clearer message) and say in the OpenAPI document
which values are accepted, so generated clients and fuzzers do not send the rest.

Numbers that travel to the nodes are bounded here: NaN or infinite floats and integers beyond
64 bits (msgspec cannot encode them) are a 400, not a failure further down.
"""
from __future__ import annotations

import logging
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from pdserve.engine.sampling_params import SamplingParams, StructuredSpec
from pdserve.router.structured_request import named_tool, structured_spec

log = logging.getLogger(__name__)
MAX_N = 128
MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


def _only(schema: dict[str, Any], why: str) -> WithJsonSchema:
    """Documents the values a validator below accepts (the validator stays the enforcer)."""
    return WithJsonSchema({**schema, "description": why})


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _invalid_unicode_at(value: Any) -> str | None:
    """Path of the first string (or object key) holding a lone UTF-16 surrogate, which JSON's
    \\u escapes can carry but neither the tokenizer nor a UTF-8 reply can. The path names
    only valid keys, since it goes into the error message. Iterative: the JSON parser allows
    nesting deeper than the recursion limit left at this point."""
    stack: list[tuple[tuple, Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str) and not _encodes(item):
            return ".".join(map(str, path)) or "the body"
        if isinstance(item, dict):
            if not all(_encodes(k) for k in item if isinstance(k, str)):
                return f"a key in {'.'.join(map(str, path)) or 'the body'}"
            children = item.items()
        elif isinstance(item, list):
            children = enumerate(item)
        else:
            continue
        # Numbers (long token-id lists) need no check: skip them rather than stack them.
        stack.extend(((*path, k), v) for k, v in children if isinstance(v, (str, dict, list)))
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


Penalty = Annotated[float, Field(ge=-2, le=2)]
LogitBias = Annotated[float, Field(ge=-100, le=100)]


class GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(1, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # Keys: token ids (as strings, as OpenAI sends them); checked against the vocabulary later.
    logit_bias: dict[str, LogitBias] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    # vLLM extras.
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    include_stop_str_in_output: bool = False
    # vLLM's `return_token_ids`: choices (and stream chunks) also carry the generated ids,
    # which lets a multi-round client resend the exact history tokens.
    return_token_ids: bool = False
    # vLLM's sampling and structured-output extras.
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    min_tokens: int | None = Field(None, ge=0, le=INT64_MAX)
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _reject_invalid_unicode(cls, data: Any) -> Any:
        path = _invalid_unicode_at(data)
        if path is not None:
            raise ValueError(f"{path} is not valid Unicode (a lone surrogate escape)")
        return data

    @model_validator(mode="after")
    def _log_ignored_fields(self) -> GenerationRequest:
        if self.model_extra:  # as vLLM does: accepted, ignored, and said so
            log.warning("ignored unknown request fields: %s", sorted(self.model_extra))
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.strip().isdigit()) or int(key) > INT64_MAX:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return value

    def structured(self) -> StructuredSpec | None:
        """The structured-output constraint asked for, checked (ValueError when malformed)."""
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        return structured_spec(self.response_format, self.structured_outputs, guided, self.tool())

    def tool(self) -> tuple[str, str] | None:
        return None  # chat requests may name one (ChatCompletionRequest.tool)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None, index: int,
                        bad_words_token_ids: list[list[int]] = (),
                        structured: StructuredSpec | None = None) -> SamplingParams:
        """Engine params for choice `index`; raises ValueError on invalid values.

        Choice i gets seed+i so n>1 with a seed gives n different but reproducible samples.
        """
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=None if self.seed is None else self.seed + index,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            min_tokens=self.min_tokens or 0,
            bad_words_token_ids=[list(w) for w in bad_words_token_ids],
            structured=structured,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )


_ONE_PROMPT = {"minItems": 1, "maxItems": 1}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}


class CompletionRequest(GenerationRequest):
    # Ids outside the vocabulary (negative ones included) are refused by the router, per model.
    prompt: Annotated[str | list[int] | list[str] | list[list[int]], _only(
        {"anyOf": [{"type": "string"}, _IDS, {"type": "array", "items": {"type": "string"}, **_ONE_PROMPT},
                   {"type": "array", "items": _IDS, **_ONE_PROMPT}]},
        "One prompt: text or token ids (a list of one of either is accepted too).")]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="Only equal to n.")
    suffix: Annotated[str | None, _only({"enum": ["", None]}, "Not supported.")] = None

    @model_validator(mode="after")
    def _reject_completion_only(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (prompt logprobs are not computed)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.num_choices:
            raise ValueError("best_of is not supported (only equal to n)")
        return self

    def single_prompt(self) -> str | list[int]:
        """The one prompt in the request; ValueError for a batch (not supported)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            return prompt[0]  # type: ignore[return-value]
        return prompt  # type: ignore[return-value]


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Annotated[str, _only({"const": "text"}, "Only text parts.")]
    text: str = ""

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value != "text":
            raise ValueError(f"content parts of type {value!r} are not supported (only 'text')")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _reject_chat_only(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def tool(self) -> tuple[str, str] | None:
        """(name, parameters schema) of the function tool_choice names, or None."""
        return named_tool(self.tools, self.tool_choice)

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are sent.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def engine_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def plain_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class HealthReport(BaseModel):
    """GET /health's body, for the OpenAPI document; backends add their own keys (nodes...)."""
    model_config = ConfigDict(extra="allow")
    healthy: bool
