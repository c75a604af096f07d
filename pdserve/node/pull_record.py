"""A decode node's record of one pull: the KV a request waits for, from its handover or the
store, through the pull's states (node.decode keeps one table of them)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.engine.request import Request
from pdserve.wire.handover import KVHandover
from pdserve.wire.messages import DecodeRequest


class PullState(enum.Enum):
    DELAYED = "delayed"      # admitted; its pull starts once pull_delay_s has passed
    PULLING = "pulling"      # a READ or fetch writes into the request's blocks
    ABANDONED = "abandoned"  # aborted while pulling: its blocks are freed once the pull ends


@dataclass
class Pull:
    state: PullState
    req: Request
    handover: KVHandover
    received_at: float
    due: float = 0.0                # DELAYED: when the pull may start
    path: str = ""                  # PULLING: the puller's transport, and what it moves
    started: float = 0.0
    nbytes: int = 0                 # the blocks' bytes
    written: bool = False           # push mode: the prefill node WROTE them here (nothing READ)
    state_nbytes: int = 0           # a hybrid model's state slot, moved with them
    # ABANDONED: the router resumed the request here under the same id (no other decode node
    # was up); it is admitted once the aborted pull ends.
    resume: tuple[bytes, DecodeRequest] | None = None
    store_prefix: bool = False      # the leading blocks of a prompt computed here, from the store
    prefetch: bool = False          # a push-mode request's stored prefix, loaded before its KVReady
    unowed: bool = False            # it reads blocks the sender did not put (StoreHandover.put_from)
