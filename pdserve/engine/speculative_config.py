"""--speculative-config: vLLM's keys, checked when the engine's config is made (the settings of
pdserve.spec_decode, which sits above the engine)."""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

METHODS = ("ngram", "suffix", "draft_model", "eagle", "mtp")
# vLLM's defaults for suffix decoding (its speculative config's suffix_decoding_* keys).
SUFFIX_DEFAULTS = {"suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 10000,
                   "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}


class SpeculativeConfig(BaseModel):
    """{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}
    or {"method": "draft_model" | "eagle", "model": DIR, "num_speculative_tokens": k}
    or {"method": "mtp", "num_speculative_tokens": k} (model: the target's own directory by default)
    or {"method": "suffix", "num_speculative_tokens": k (default: the tree's depth), "suffix_decoding_*": ...}."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "suffix", "draft_model", "eagle", "mtp"]
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    # vLLM's key: no drafts in a step with at least this many decoding requests (None: never
    # turned off outright; the per-request step-down in pdserve.spec_decode.step_down still runs).
    disable_by_batch_size: int | None = None
    # Suffix decoding (pdserve.spec_decode.suffix): the trees' depth (the longest pattern plus
    # draft), the outputs the global tree keeps, drafts up to factor x the matched length, and
    # the probability below which a draft stops.
    suffix_decoding_max_tree_depth: int = SUFFIX_DEFAULTS["suffix_decoding_max_tree_depth"]
    suffix_decoding_max_cached_requests: int = SUFFIX_DEFAULTS["suffix_decoding_max_cached_requests"]
    suffix_decoding_max_spec_factor: float = SUFFIX_DEFAULTS["suffix_decoding_max_spec_factor"]
    suffix_decoding_min_token_prob: float = SUFFIX_DEFAULTS["suffix_decoding_min_token_prob"]

    @model_validator(mode="before")
    @classmethod
    def _suffix_k(cls, data):
        """vLLM's default k for suffix decoding: the tree's depth."""
        if isinstance(data, dict) and data.get("method") == "suffix" and "num_speculative_tokens" not in data:
            data = {**data, "num_speculative_tokens": min(data.get("suffix_decoding_max_tree_depth", 24), 32)}
        return data

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"num_speculative_tokens must be in [1, 32], got {self.num_speculative_tokens}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be at least 1, got {self.disable_by_batch_size}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("method ngram takes no model")
            lo, hi = self.lookup_range
            if not 1 <= lo <= hi:
                raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
        elif self.method == "suffix":
            self._check_suffix()
        elif self.model is None and self.method != "mtp":
            raise ValueError(f"method {self.method} needs a model (a directory or builtin: name)")
        if self.method != "suffix":
            given = [key for key, value in SUFFIX_DEFAULTS.items() if getattr(self, key) != value]
            if given:
                raise ValueError(f"{', '.join(given)}: keys of method suffix, not {self.method}")
        return self

    def _check_suffix(self) -> None:
        if self.model is not None:
            raise ValueError("method suffix takes no model")
        if not 2 <= self.suffix_decoding_max_tree_depth <= 64:
            raise ValueError(f"suffix_decoding_max_tree_depth must be in [2, 64], got {self.suffix_decoding_max_tree_depth}")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_cached_requests must be at least 0 (0: no global tree)")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("suffix_decoding_max_spec_factor must be positive")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1]")

    @property
    def lookup_range(self) -> tuple[int, int]:
        """(min, max) n-gram lengths, with vLLM's defaults: 5 and 5 when neither is given, else
        the one given for the other."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            return 5, 5
        return (hi if lo is None else lo), (lo if hi is None else hi)


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """A JSON string, a dict or a SpeculativeConfig (None: off); ValueError with the reason."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("speculative config must be a JSON object")
    if value.get("method") not in METHODS:
        raise ValueError(f"speculative config: unknown method {value.get('method')!r}; "
                         f"supported: {', '.join(METHODS)}")
    try:
        return SpeculativeConfig(**value)
    except ValidationError as exc:
        reasons = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"bad speculative config: {reasons}") from None
