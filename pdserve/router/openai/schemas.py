"""Request models for the OpenAI-compatible endpoints (pydantic lives only at this HTTP edge).

Unknown fields are tolerated (extra="allow") so clients that send newer OpenAI fields keep
working; each request's ignored fields are logged and named in the response's
`X-Ignored-Fields` header. Fields the engine cannot honour (suffix, best_of != n without beam search) are
rejected with 400 rather than silently ignored, because a silently ignored knob yields outputs
the client did not ask for. Those knobs keep their validators (for the clearer message) and
say in the OpenAPI document which values are accepted, so generated clients and fuzzers do not
send the rest.

Numbers that travel to the nodes are bounded here: NaN or infinite floats and integers beyond
64 bits (msgspec cannot encode them) are a 400, not a failure further down.
"""
from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal
from urllib.parse import quote

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from pdserve.protocol.cache_salt import MAX_CACHE_SALT_BYTES, check_cache_salt
from pdserve.protocol.sampling_params import SamplingParams, StructuredSpec
from pdserve.router.openai.chat_message import ChatMessage
from pdserve.router.openai.media import ImageRef
from pdserve.router.openai.structured_request import ToolPlan, structured_spec, tool_plan
from pdserve.router.placement.pd_decision import Targets

log = logging.getLogger(__name__)
MAX_N = 128
MAX_LOGPROBS = 20
MAX_PROMPTS = 1024  # prompts in one /v1/completions batch
MAX_CHOICES = 1024  # prompts x n: each choice is a request on the nodes
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


def _check_cache_salt(value: str | None) -> str | None:
    check_cache_salt(value)  # ValueError: a 400 naming the field
    return value


# A non-empty string of at most MAX_CACHE_SALT_BYTES, without NUL (pdserve.protocol.cache_salt).
# maxLength counts characters, which are at least one byte each: the byte limit stays the validator's.
CacheSalt = Annotated[str | None, AfterValidator(_check_cache_salt), WithJsonSchema({
    "anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_BYTES, "pattern": "^[^\\x00]*$"},
              {"type": "null"}],
    "description": "Cached KV is shared only between requests with the same salt: "
                   f"a non-empty string of at most {MAX_CACHE_SALT_BYTES} UTF-8 bytes, without NUL."})]


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


class UnicodeCheckedRequest(BaseModel):
    """A request body whose strings must all be valid Unicode: every route that tokenizes text
    (completions, chat, responses, embeddings) refuses a lone surrogate with a 400."""

    @model_validator(mode="before")
    @classmethod
    def _reject_invalid_unicode(cls, data: Any) -> Any:
        path = _invalid_unicode_at(data)
        if path is not None:
            raise ValueError(f"{path} is not valid Unicode (a lone surrogate escape)")
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


Penalty = Annotated[float, Field(ge=-2, le=2)]
_NON_EMPTY = {"minLength": 1}  # structured_request's rule for guided_*
# structured_spec takes one structured output at a time: each branch lets one of these be non-null.
# (A response_format of type text counts here though the server ignores it: the document is the stricter.)
_STRUCTURED = ["response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"]
STRUCTURED_AT_MOST_ONE = {"anyOf": [{"properties": {other: {"type": "null"} for other in _STRUCTURED if other != kept}}
                                    for kept in _STRUCTURED]}
LogitBias = Annotated[float, Field(ge=-100, le=100)]


class GenerationRequest(UnicodeCheckedRequest):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's range
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(1, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, _only(
        {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1}},
                   {"type": "null"}]},
        "Where to stop: a string or a list of strings, none of them empty.")] = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # Keys: token ids (as strings, as OpenAI sends them); checked against the vocabulary later.
    logit_bias: Annotated[dict[str, LogitBias] | None, Field(json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"}})] = None
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
    guided_regex: str | None = Field(None, json_schema_extra=_NON_EMPTY)
    guided_choice: list[str] | None = Field(None, json_schema_extra={"minItems": 1, "items": _NON_EMPTY})
    guided_grammar: str | None = Field(None, json_schema_extra=_NON_EMPTY)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's: each prompt token's logprob and the top-N (the first token's entry is null).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # pdserve's: this request's TTFT and inter-token latency targets, for --prefill-placement slo
    # (default: the router's --ttft-slo-ms/--itl-slo-ms).
    ttft_slo_ms: float | None = Field(None, gt=0, le=3_600_000)
    itl_slo_ms: float | None = Field(None, gt=0, le=3_600_000)
    # vLLM's: cached KV is shared only between requests with the same salt (docs/adapters-and-tenants.md).
    cache_salt: CacheSalt = None
    # vLLM's beam search (pdserve.router.openai.beam_job): best_of beams (default n), the best n
    # returned; scores are sum(logprobs) / length ** length_penalty (transformers' rules).
    use_beam_search: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N, description=(
        "With use_beam_search: the beam width, at least n (default n). Without it: only equal to n."))
    length_penalty: float = Field(1.0, ge=-10, le=10)
    early_stopping: bool | Literal["never"] = False

    @model_validator(mode="after")
    def _check_best_of(self) -> GenerationRequest:
        if self.best_of is None:
            return self
        if self.use_beam_search and self.best_of < self.num_choices:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.num_choices})")
        if not self.use_beam_search and self.best_of != self.num_choices:
            raise ValueError("best_of other than n needs use_beam_search (sampled best_of is not supported)")
        return self

    @model_validator(mode="after")
    def _log_ignored_fields(self) -> GenerationRequest:
        if self.model_extra:  # as vLLM does: accepted, ignored, and said so
            log.info("ignored unknown request fields: %s", sorted(self.model_extra))
        return self

    @property
    def ignored_fields(self) -> list[str]:
        """The unknown fields' names, percent-encoded (they go into a header, which is latin-1)."""
        return sorted(quote(name, safe="") for name in self.model_extra or {})

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        # An empty stop string matches at once: the answer would be empty, with finish_reason "stop".
        if value == "" or (isinstance(value, list) and "" in value):
            raise ValueError("stop strings must not be empty")
        return value

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
        return structured_spec(self.response_format, self.structured_outputs, guided, self.tools_plan())

    def tools_plan(self) -> ToolPlan | None:
        return None  # chat requests may offer tools (ChatCompletionRequest.tools_plan)

    def targets(self, default: Targets | None) -> Targets | None:
        """The request's TTFT/ITL targets: its own where given, else `default`'s (None: unset)."""
        if self.ttft_slo_ms is None and self.itl_slo_ms is None:
            return None
        ttft = self.ttft_slo_ms / 1e3 if self.ttft_slo_ms is not None else (default.ttft_s if default else None)
        itl = self.itl_slo_ms / 1e3 if self.itl_slo_ms is not None else (default.itl_s if default else None)
        return Targets(ttft, itl)

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
            prompt_logprobs=self.prompt_logprobs,
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


_BATCH = {"minItems": 1, "maxItems": MAX_PROMPTS}
_TEXT = {"type": "string", "minLength": 1}  # an empty text has no token to start from
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}


# _check_best_of's rule (best_of equal to n without use_beam_search, at least n with it) is only
# described on best_of: as a schema rule next to STRUCTURED_AT_MOST_ONE it leaves the fuzzer's
# generator (schemathesis) unable to model the body.
# _reject_completion_only's rule: max_tokens 0 only with echo.
_COMPLETION_RULES = [
    {"if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
     "then": {"required": ["echo"], "properties": {"echo": {"const": True}}}},
    STRUCTURED_AT_MOST_ONE,
]


class CompletionRequest(GenerationRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": _COMPLETION_RULES})
    # Ids outside the vocabulary (negative ones included) are refused by the router, per model.
    prompt: Annotated[str | list[int] | list[str] | list[list[int]], _only(
        {"anyOf": [_TEXT, _IDS, {"type": "array", "items": _TEXT, **_BATCH},
                   {"type": "array", "items": _IDS, **_BATCH}]},
        "Text or token ids, or a batch: a list of texts or of token-id lists. Choice i*n+j is "
        "prompt i's choice j.")]
    # 0 with echo: only the prompt (and with logprobs, its logprobs) comes back.
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: Annotated[str | None, _only({"enum": ["", None]}, "Not supported.")] = None

    @model_validator(mode="after")
    def _reject_completion_only(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo=true)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch (ValueError when empty or too many)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if not isinstance(prompt[0], (str, list)):
            return [prompt]  # type: ignore[list-item]
        if len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}")
        if len(prompt) * self.num_choices > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} choices (prompts x n) in one request, "
                             f"got {len(prompt)} x {self.num_choices}")
        return list(prompt)  # type: ignore[arg-type]

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo: the engine draws one token, which nobody is shown."""
        return bool(self.echo) and self.max_tokens == 0


class ChatCompletionRequest(GenerationRequest):
    # _reject_chat_only's rule: top_logprobs only with logprobs.
    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
         "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
        STRUCTURED_AT_MOST_ONE]})
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (default true, as OpenAI)

    @model_validator(mode="after")
    def _reject_chat_only(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def tools_plan(self) -> ToolPlan | None:
        """What tool_choice asks for with these tools (ValueError when malformed)."""
        return tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls is not False)

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are sent.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def engine_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def image_refs(self) -> list[ImageRef]:
        """Every image part of every message, in order."""
        return [ref for i, m in enumerate(self.messages) for ref in m.image_refs(i)]

    def plain_messages(self, with_images: bool = False) -> list[dict[str, Any]]:
        """Messages as chat templates take them: text content, tool calls with their
        arguments as objects (templates render them), the id a tool turn answers. with_images:
        a message with image parts keeps its parts, each image as {"type": "image"} (where a
        vision-language model's template puts its placeholder)."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            content = m.template_parts() if with_images and m.image_refs(0) else m.text()
            message: dict[str, Any] = {"role": m.role, "content": content}
            if m.name is not None:
                message["name"] = m.name
            if m.tool_calls:
                message["tool_calls"] = [_template_call(c) for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # not JSON: the template gets the text as sent
    return {**call, "function": function}


class HealthReport(BaseModel):
    """GET /health's body, for the OpenAPI document; backends add their own keys (nodes...)."""
    model_config = ConfigDict(extra="allow")
    healthy: bool
