"""Push mode over the store (`--prefetch-stored-prefix`): a decode node loads the leading blocks
of a waiting request's prompt that the store holds already (an earlier turn's, a shared
prefix's) while its prefill node computes the prompt, so that after the first token only the
rest moves. It starts once the prefill node's own load of that prefix is over (PrefixLoaded, which
the router relays): two loads of one prefix at once slowed the prefill node's, hence the first
token (docs/benchmarks/handover.md). Not over NIXL, whose WRITEs may be landing in the same
blocks, nor for a hybrid model, whose state comes with the whole prompt."""
from __future__ import annotations

import math
import time
from typing import Protocol

from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import Request, RequestStatus
from pdserve.node.node_stats import NodeStats
from pdserve.node.pull_record import Pull, PullState
from pdserve.node.pullers import Puller
from pdserve.node.store_prefix import StorePrefix, request_block_keys
from pdserve.wire.handover import NixlHandover, StoreHandover
from pdserve.wire.messages import DecodeRequest, KVReady


class PrefetchHost(Protocol):
    """What of the decode node (pdserve.node.decode) this uses."""
    engine: LLMEngine
    pulls: dict[str, Pull]
    pullers: dict[type, Puller]
    store_prefix: StorePrefix | None
    stats: NodeStats
    block_nbytes: int

    def admit_pushed(self, identity: bytes, msg: DecodeRequest, ready: KVReady) -> None: ...


class StorePrefetch:
    def __init__(self, node: PrefetchHost, enabled: bool):
        self.node = node
        self.enabled = enabled
        self.due: dict[str, DecodeRequest] = {}  # admitted, waiting for the prefill node's PrefixLoaded
        self.parked: dict[str, tuple[bytes, DecodeRequest, KVReady]] = {}  # KVReadys come while a prefetch runs

    def await_prefill_load(self, req: Request, msg: DecodeRequest) -> None:
        """A push-mode request admitted with its blocks (node.push_intake): its prefetch waits for
        the prefill node's PrefixLoaded."""
        node = self.node
        if (self.enabled and StoreHandover in node.pullers and NixlHandover not in node.pullers
                and req.state_slot is None):
            self.due[msg.request_id] = msg

    def prefix_loaded(self, rid: str) -> None:
        """The prefill node's PrefixLoaded: the request's prefetch starts, if it still waits."""
        msg, req = self.due.pop(rid, None), self.node.engine.get_request(rid)
        if msg is not None and req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            self._start(req, msg)

    def park(self, identity: bytes, msg: DecodeRequest, ready: KVReady) -> bool:
        """The request's KVReady came. True: its prefetch runs, and the KVReady waits for it
        (admit_pushed again once it ends)."""
        rid = msg.request_id
        self.due.pop(rid, None)  # (its PrefixLoaded never came: nothing was prefetched)
        pull = self.node.pulls.get(rid)
        if pull is None or not pull.prefetch:
            return False
        self.parked[rid] = (identity, msg, ready)
        return True

    def forget(self, rid: str) -> None:
        self.due.pop(rid, None)
        self.parked.pop(rid, None)

    def _start(self, req: Request, msg: DecodeRequest) -> None:
        """The leading blocks the store holds that this node's cache lacks, fetched into the
        request's blocks as a Pull with prefetch set."""
        node = self.node
        engine, puller, bs = node.engine, node.pullers[StoreHandover], node.engine.config.block_size
        keys = request_block_keys(engine, msg.prompt_token_ids, msg.cache_salt, msg.adapter, msg.images)
        first = max(req.num_computed_tokens // bs, req.num_slid_blocks)
        if first >= (len(msg.prompt_token_ids) - 1) // bs:
            return  # every block a store could hold is cached here
        stored = node.store_prefix.stored_tokens(keys, len(msg.prompt_token_ids))
        if stored // bs <= first:
            return
        now = time.monotonic()
        handover = node.store_prefix.handover(keys, stored)
        if puller.start(req.request_id, handover, req.block_ids[:stored // bs], first, now, math.inf):
            node.pulls[req.request_id] = Pull(PullState.PULLING, req, handover, now, path=puller.path,
                                              started=time.perf_counter(), nbytes=(stored // bs - first) * node.block_nbytes,
                                              prefetch=True)

    def finished(self, pull: Pull, ok: bool) -> None:
        """A prefetch ended: loaded (its tokens count as computed), or not (its KVReady's pull
        moves them all); a KVReady parked meanwhile is admitted now."""
        node, req = self.node, pull.req
        if ok:
            req.num_computed_tokens = max(req.num_computed_tokens, pull.handover.num_tokens)
            node.stats.store_prefetched_tokens += pull.nbytes // node.block_nbytes * node.engine.config.block_size
            node.stats.store_load_us += int((time.perf_counter() - pull.started) * 1e6)
        if (ready := self.parked.pop(req.request_id, None)) is not None:
            node.admit_pushed(*ready)
