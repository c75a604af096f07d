"""Modelled nodes: a prefix cache with LRU eviction, a FIFO prefill server, a continuous-batching
decode server. Their costs come from NodeCosts; their cache changes go to the router's real
PrefixIndex, as the real nodes' KV events do.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pdserve.router.placement.index import PrefixIndex


@dataclass
class SimRequest:
    rid: int
    session: int
    round: int
    arrival: float
    prompt: list[int]
    keys: list[bytes]             # block keys of the prompt's full blocks
    output_tokens: int
    cached_tokens: int = 0        # prompt tokens not computed (any cache)
    local_prefill: int = 0        # tokens the decode node prefills itself
    prefill_left: int = 0         # ... of which it has not computed yet
    handed_blocks: int = 0        # blocks moved from a prefill node to the decode node
    blocks: int = 0               # KV blocks it holds on its decode node while running
    first_token: float | None = None
    finish: float | None = None
    remaining: int = 0            # tokens still to decode
    decode_node: str = ""
    prefill_node: str | None = None


class PrefixCache:
    """A node's cached blocks, least recently used first; changes are reported to the index."""

    def __init__(self, node_id: str, index: PrefixIndex | None, enabled: bool = True):
        self.node_id = node_id
        self.index = index
        self.enabled = enabled  # prefix caching off: the node keeps nothing
        self.keys: OrderedDict[bytes, None] = OrderedDict()

    def held_prefix(self, keys: list[bytes]) -> int:
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            n += 1
        return n

    def insert(self, keys: list[bytes]) -> None:
        if not self.enabled:
            return
        new = [k for k in keys if k not in self.keys]
        for key in keys:
            self.keys[key] = None
            self.keys.move_to_end(key)
        if new and self.index is not None:
            self.index.add(self.node_id, new)

    def evict_to(self, limit: int) -> None:
        gone = []
        while len(self.keys) > max(limit, 0):
            gone.append(self.keys.popitem(last=False)[0])
        if gone and self.index is not None:
            self.index.remove(self.node_id, gone)


@dataclass
class SimPrefillNode:
    node_id: str
    cache: PrefixCache
    capacity_blocks: int
    queue: deque = field(default_factory=deque)
    busy: bool = False
    queued_tokens: int = 0        # prompt tokens sent here and not done (the router's count)


@dataclass
class SimDecodeNode:
    node_id: str
    cache: PrefixCache
    total_blocks: int
    max_seqs: int
    running: list = field(default_factory=list)
    waiting: deque = field(default_factory=deque)
    in_use: int = 0               # blocks held by running requests beyond their cached prefix
    stepping: bool = False
    routed: int = 0               # requests the router has sent here and not seen finish
    chunks: dict = field(default_factory=dict)  # request id -> prompt tokens prefilled in the step running

    @property
    def decoding_rows(self) -> int:
        return sum(1 for r in self.running if r.first_token is not None)

    @property
    def local_queued_tokens(self) -> int:
        """Prompt tokens to prefill here before the requests routed here for it have a first token."""
        return (sum(r.prefill_left for r in self.running if r.first_token is None)
                + sum(len(r.prompt) for r in self.waiting if r.first_token is None))

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.in_use

    def admit(self, block_size: int) -> list[SimRequest]:
        """Move waiting requests into the batch while blocks and sequence slots last (FIFO)."""
        admitted = []
        while self.waiting and len(self.running) < self.max_seqs:
            req = self.waiting[0]
            held = self.cache.held_prefix(req.keys)
            need = -(-(len(req.prompt) + req.output_tokens) // block_size) - held
            if self.in_use + need > self.total_blocks and self.running:
                break
            self.waiting.popleft()
            self.cache.insert(req.keys[:held])  # touched: the running request pins them
            req.blocks = need
            self.in_use += need
            self.running.append(req)
            admitted.append(req)
        self.cache.evict_to(self.total_blocks - self.in_use)
        return admitted
