"""--speculative-config: vLLM's keys, checked when the engine's config is made (the settings of
pdserve.spec_decode, which sits above the engine)."""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

METHODS = ("ngram", "draft_model", "eagle", "mtp")


class SpeculativeConfig(BaseModel):
    """{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}
    or {"method": "draft_model" | "eagle", "model": DIR, "num_speculative_tokens": k}
    or {"method": "mtp", "num_speculative_tokens": k} (model: the target's own directory by default)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft_model", "eagle", "mtp"]
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    # vLLM's key: no drafts in a step with at least this many decoding requests (None: never
    # turned off outright; the per-request step-down in pdserve.spec_decode.step_down still runs).
    disable_by_batch_size: int | None = None

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
        elif self.model is None and self.method != "mtp":
            raise ValueError(f"method {self.method} needs a model (a directory or builtin: name)")
        return self

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
