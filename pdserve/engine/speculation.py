"""The typed meeting point of the engine and speculative decoding (pdserve.spec_decode), which
sits above the engine: the engine calls a Speculation, and a speculator reaches the engine only
through a SpeculationHost (LLMEngine implements it). pdserve.assembly joins the two."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.protocol.outputs import StepOutput


class SpeculationHost(Protocol):
    """What a speculator and its proposers may use of the engine."""
    config: EngineConfig
    model_path: Path
    model: torch.nn.Module
    dtype: torch.dtype
    device: torch.device
    kv_cache: torch.Tensor       # the target's paged cache (a drafter sizes its own after it)
    kv: KVCacheManager           # the target's blocks: drafts allocate and commit there
    runner: ModelRunner          # set_hidden_sink: each step's hidden states, for a drafting head
    max_model_len: int

    def get_request(self, request_id: str) -> Request | None:
        """The live request of that id (None once it finished or was aborted)."""

    def advance(self, req: Request, token: int, logprob) -> StepOutput:
        """Append a verified token to a request: its stops, text and step output."""


class Speculation(Protocol):
    """What the engine calls of a speculator (pdserve.spec_decode.speculator.Speculator)."""

    def add_drafts(self, batch: ScheduledBatch) -> None:
        """Before the forward pass: drafts into the batch's decoding requests."""

    def take_drafts(self, batch: ScheduledBatch) -> dict[str, list[int]]:
        """After it: each drafted request's drafts, taken out of its tokens."""

    def advance(self, req: Request, drafts: list[int], tokens: list[int], logprobs: list) -> StepOutput:
        """A drafted request's verified tokens (the target's draws at its last token and drafts)."""

    def release(self, request_id: str) -> None:
        """A request ended: drop what the speculator keeps for it."""
