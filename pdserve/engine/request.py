"""A request's state as the engine core sees it."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.protocol.multimodal import ImageInput
from pdserve.protocol.outputs import TokenLogprob
from pdserve.protocol.sampling_params import SamplingParams

# An output token still on the device (async scheduling): filled in before anything reads it.
PENDING_TOKEN = -1


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass
class RemoteKV:
    """The prompt's KV is arriving from elsewhere (a prefill node, the KV store)."""
    num_tokens: int  # tokens whose KV will land
    deadline: float  # time.monotonic() after which the request is computed locally
    landed: bool = False
    failed: bool = False
    # A transfer is writing into the blocks: the deadline must not hand them to a recompute
    # until the transfer has ended (its own timeout bounds the wait).
    in_flight: bool = False


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache or a remote node
    block_ids: list[int] = field(default_factory=list)
    remote_kv: RemoteKV | None = None
    block_keys: list[bytes] = field(default_factory=list)  # keys of full blocks, grown lazily
    num_registered_blocks: int = 0  # leading blocks already entered in the prefix cache
    num_slid_blocks: int = 0  # leading blocks freed as out of every layer's window (KVCacheManager.slide)
    state_slot: int | None = None  # a hybrid model's recurrent-state slot while held (engine.state_pool)
    hold_blocks: bool = False  # on finish, keep the blocks (for a KV handover) until released
    matcher: Any = None  # structured output: the xgrammar matcher, past every output token
    awaiting_last_token: bool = False  # its pending token ends it (async scheduling): skip it
    in_pipeline: bool = False  # in a launched step whose results are to come (pipeline stages): skip it
    # sampling_params.prompt_logprobs: filled position by position as the prompt is computed
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Speculative decoding: tokens drafted for this step, appended to all_token_ids while the
    # step runs (pdserve.spec_decode.speculator); every row from the last token on is sampled.
    spec_token_ids: list[int] = field(default_factory=list)
    # What must never share KV with other requests: a tenant's cache salt and a LoRA adapter's
    # name. `salt` is their block-key salt (block_keys.request_salt); b"": the engine's own.
    cache_salt: str | None = None
    lora_name: str | None = None
    salt: bytes = b""
    # Images (pdserve.protocol.multimodal): their keys enter the block keys of the blocks that
    # hold their tokens; the model runner encodes them (once, see engine.multimodal) when a
    # step computes those tokens. mrope: a multimodal-RoPE model's prompt positions [3, P] and
    # the delta every later token's index takes (pdserve.models.mrope); None for 1-D positions.
    images: tuple[ImageInput, ...] = ()
    mrope: tuple[Any, int] | None = None
    all_token_ids: list[int] = field(init=False)
    lora_slot: int | None = field(default=None, init=False)  # the adapter's slot while held (pdserve.lora.manager)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
