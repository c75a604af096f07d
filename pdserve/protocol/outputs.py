"""What the engine reports: per-step deltas and the offline API's final outputs."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.protocol.timing import NodeTiming


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    # (token_id, logprob) of the most likely tokens, when top logprobs were asked for.
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int = 0  # 1 + how many tokens were more likely (0: not computed)


@dataclass
class StepOutput:
    """One request's progress in one engine step."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    new_logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # With the first token, when prompt logprobs were asked for: one entry per prompt token,
    # the first None (nothing predicts it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # With a request's first output from a node: where its time went there (protocol.timing).
    timing: NodeTiming | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
