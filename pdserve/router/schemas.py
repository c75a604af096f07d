"""Request models for the OpenAI-compatible endpoints (pydantic lives only at this HTTP edge).

Unknown fields are tolerated (extra="allow") so clients that send newer OpenAI fields keep
working. Fields the engine cannot honour are rejected with 400 rather than silently ignored,
because a silently ignored knob yields outputs the client did not ask for:
  * presence_penalty / frequency_penalty: accepted only when absent or 0.
  * logit_bias: accepted only when absent or empty.
  * echo=true, suffix, best_of != n, tools: rejected.
  * a batch of prompts (more than one) in /v1/completions: rejected; send one per request.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.engine.sampling_params import SamplingParams

MAX_N = 128
MAX_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = Field(1, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras.
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # vLLM's `return_token_ids`: choices (and stream chunks) also carry the generated ids,
    # which lets a multi-round client resend the exact history tokens.
    return_token_ids: bool = False

    @model_validator(mode="after")
    def _reject_unsupported(self) -> "GenerationRequest":
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ValueError(f"{name} is not supported (only 0 or absent)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        index: int) -> SamplingParams:
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
        )


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _reject_completion_only(self) -> "CompletionRequest":
        if self.echo:
            raise ValueError("echo is not supported")
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
    type: str
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
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None

    @model_validator(mode="after")
    def _reject_chat_only(self) -> "ChatCompletionRequest":
        if self.tools:
            raise ValueError("tools are not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

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
