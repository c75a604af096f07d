"""Per-request sampling settings (vLLM-shaped)."""
from __future__ import annotations

from dataclasses import dataclass, field

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredSpec:
    """What the output must match, carried as a spec (not matcher state) so it crosses the
    P/D handover as plain data; each node compiles it (cached) and replays the tokens so far.
    kind: "json" (spec: a JSON schema, as text), "regex", "choice" (spec: a JSON list of
    strings), "grammar" (EBNF) or "structural_tag" (xgrammar's structural tag as JSON: free
    text until a trigger, then tagged content; tool calls under tool_choice "auto")."""
    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; 0: sampled token only; k: plus top-k
    # None: off; k: each prompt token's logprob plus the top-k. The whole prompt is then
    # computed (a cached prefix has no logits), and the first token's output carries them.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # Penalties and biases (pdserve/engine/logits_processors.py). presence/frequency: OpenAI's
    # formula over the generated tokens; repetition: HF's, over prompt and generated tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0  # EOS and stop_token_ids are barred until this many tokens exist
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # never completed
    structured: StructuredSpec | None = None
    # Text options (vLLM's): decode with or without special tokens; the spaces option only
    # changes slow tokenizers, as in vLLM and transformers.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}")
        self._check_penalties()

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 100:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if any(not -100 <= v <= 100 for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        # Not bounded by max_tokens here: the prefill node lowers max_tokens to 1 on a copy.
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids or []]
        if any(not w for w in self.bad_words_token_ids):
            raise ValueError("bad words must have at least one token")

    @property
    def has_logits_processors(self) -> bool:
        """Whether any per-request logits edit applies (rows without one pay nothing)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
