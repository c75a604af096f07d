"""Prefill node: computes prompts' KV and first tokens, then hands the KV to a decode node
through the KV store or by pinning the blocks for a NIXL READ (freed on the decode node's
notification or when the lease expires).

It also serves whole requests (a DecodeRequest with no KV to pull): the router's monolithic
fallback under --prefill-placement slo, when the decode nodes' steps have no room left under
their ITL target and this node has. Those streams keep their target here as on a decode node
(pdserve.node.step_budget), which also caps the prompts this node prefills for others."""
from __future__ import annotations

import dataclasses
import logging
import time

from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import RequestStatus
from pdserve.kvstore.base import KVStore
from pdserve.kvstore.errors import KVStoreError
from pdserve.node.borrowed_prefix import BorrowedPrefix
from pdserve.node.producers import MISSING, NixlProducer, PendingPrefill, Producer, StoreProducer
from pdserve.node.push_writes import PushWriter
from pdserve.node.runtime import NodeRuntime
from pdserve.node.step_budget import StepBudget
from pdserve.node.store_prefix import StorePrefix, request_block_keys
from pdserve.node.store_puts import StorePuts
from pdserve.protocol.grammar import DEAD_END_FINISH
from pdserve.protocol.outputs import StepOutput
from pdserve.wire.handover import KVHandover
from pdserve.wire.messages import (
    DecodeRequest,
    HandoverMade,
    Message,
    Ping,
    Pong,
    PrefillRequest,
    PrefillResult,
    PrefixLoaded,
    Rejected,
    WriteTarget,
)

log = logging.getLogger(__name__)
# Push mode: how long a made handover waits for its decode node's WriteTarget. The router sends
# an empty one when that node is lost (inflight), so this bounds only a live decode node that is
# slow to admit the request; at 1 s a loaded machine's slow admission fell back to READs.
TARGET_WAIT_S = 10.0


class PrefillNode(StepBudget):
    role = "prefill"

    def __init__(self, engine: LLMEngine, bind: str | NodeRuntime, node_id: str, store: KVStore | None = None,
                 nixl_side_channel: str | None = None, lease_s: float = 30.0, advertise_host: str | None = None,
                 layer_groups: int = 0):
        """layer_groups: push mode's layer-wise WRITEs (node.push_writes; 0: whole blocks after each step)."""
        super().__init__(engine, bind, node_id)
        self.store = store
        self.store_prefix = StorePrefix(engine, store, self.stats) if store is not None else None
        self.pending: dict[str, PendingPrefill] = {}
        # push mode over NIXL: first token out, the handover waiting for its WriteTarget (since when)
        self.awaiting: dict[str, tuple[PendingPrefill, float]] = {}
        self.whole_requests = 0  # requests prefilled and decoded here (the router's fallback)
        self.target_timeouts = 0  # push-mode handovers made without a WriteTarget after TARGET_WAIT_S
        self.init_step_budget()
        self.nixl: NixlProducer | None = None
        self.writer: PushWriter | None = None  # push mode: WRITEs into the decode node's blocks
        self.borrowed: BorrowedPrefix | None = None  # ... and READs of the blocks it lends
        if nixl_side_channel:
            self.nixl = NixlProducer(engine, node_id, self.ctx, nixl_side_channel, advertise_host, lease_s, self.stats)
            self.writer = PushWriter(engine, self.nixl.agent, self.stats, layer_groups)
            self.borrowed = BorrowedPrefix(engine, self.nixl.agent, self.stats)
        producers = [StoreProducer(engine, store, self.stats)] if store is not None else []
        self.puts = StorePuts(producers[0]) if producers else None  # store handovers, off this loop
        # By the transport a request names.
        self.producers: dict[str, Producer] = {p.transport: p for p in [*producers, self.nixl] if p is not None}

    # ---- requests -------------------------------------------------------------------------
    def handle(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, PrefillRequest):
            self._admit(identity, msg)
        elif isinstance(msg, WriteTarget):
            self._take_target(msg)
        elif isinstance(msg, DecodeRequest) and not msg.pulls_kv():
            self._admit_whole(identity, msg)
        elif isinstance(msg, DecodeRequest):  # sent before the router saw this node switch roles
            self.control.send(identity, Rejected(msg.request_id, "this node serves prefill now"))
        else:
            log.warning("prefill node ignores %s", type(msg).__name__)

    def _admit(self, identity: bytes, req: PrefillRequest) -> None:
        rid = req.request_id
        if req.transfer not in self.producers:
            return self._reply_error(identity, rid, MISSING[req.transfer])
        self.take_embeddings(req.images, req.embeddings)  # an encoder node's, over NIXL or through the store
        # Only the first token is drawn here; the decode node draws the rest.
        params = dataclasses.replace(req.params, max_tokens=1)
        prefix = self.store_prefix
        keys = request_block_keys(self.engine, req.prompt_token_ids, req.cache_salt, req.adapter, req.images)
        stored = prefix.stored_tokens(keys, len(req.prompt_token_ids)) if prefix else 0
        borrow = self.borrowed.tokens_to_borrow(req, stored) if self.borrowed is not None else 0
        try:
            engine_req = self.engine.add_request(rid, req.prompt_token_ids, params, hold_blocks=True,
                                                 remote_kv_tokens=stored or borrow,
                                                 continues_elsewhere=req.params.max_tokens > 1,
                                                 cache_salt=req.cache_salt, lora_name=req.adapter,
                                                 images=req.images)
        except ValueError as exc:
            return self._reply_error(identity, rid, str(exc))
        self.ttft_clocks.admit(engine_req)
        if stored and engine_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            # (When the cache had no room for the stored blocks the request just computes.)
            prefix.load(engine_req, keys, stored)
            self.ttft_clocks.landed(rid)
        elif borrow and engine_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.borrowed.await_target(engine_req, borrow)  # the decode node's WriteTarget lends them
        if req.push and req.transfer == "store":  # (the load above is over: the decode node's may start)
            self.control.send(identity, PrefixLoaded(rid))
        self.pending[rid] = PendingPrefill(identity, req, keys, stored)
        # Until its blocks are free: a router that goes silent takes its prefills and leases with it.
        self.origin[rid] = identity
        self.stats.requests_total += 1

    def _admit_whole(self, identity: bytes, msg: DecodeRequest) -> None:
        """Prefill and decode the request here, streaming its tokens as a decode node does."""
        rid = msg.request_id
        self.take_embeddings(msg.images)
        prefix = None if msg.first_token_ids else self.store_prefix  # a resumed stream recomputes
        keys = request_block_keys(self.engine, msg.prompt_token_ids, msg.cache_salt, msg.adapter, msg.images)
        stored = prefix.stored_tokens(keys, len(msg.prompt_token_ids)) if prefix else 0
        try:
            req = self.engine.add_request(rid, msg.prompt_token_ids, msg.params, output_token_ids=msg.first_token_ids,
                                          remote_kv_tokens=stored, cache_salt=msg.cache_salt, lora_name=msg.adapter,
                                          images=msg.images)
        except ValueError as exc:
            return self.fail(identity, rid, str(exc))
        self.ttft_clocks.admit(req)
        if stored and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            prefix.load(req, keys, stored)  # a turn whose history left this node: from the store
            self.ttft_clocks.landed(rid)
        self.origin[rid] = identity
        self.stats.requests_total += 1
        self.whole_requests += 1
        self.hold_itl_target(rid, msg.itl_slo_s)

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        whole = []  # whole requests' outputs, streamed as a decode node's are
        for out in outputs:
            pending = self.pending.pop(out.request_id, None)
            if pending is not None:
                self._hand_over(pending, out)
            else:
                whole.append(out)
        super().on_outputs(whole)

    def pong(self, ping: Ping) -> Pong:
        pong = super().pong(ping)
        pong.stats.update(**self.budget_stats(), whole_requests=self.whole_requests, serves_whole=1,
                          reads_store=int(self.store_prefix is not None),
                          push_writes=self.writer.writes if self.writer is not None else 0,
                          push_layer_writes=self.writer.layer_writes if self.writer is not None else 0,
                          push_write_failures=self.writer.failures if self.writer is not None else 0,
                          push_targets_empty=self.writer.empty_targets if self.writer is not None else 0,
                          push_target_timeouts=self.target_timeouts)
        return pong

    def _hand_over(self, pending: PendingPrefill, first: StepOutput) -> None:
        req = pending.request
        rid = req.request_id
        done = first.finish_reason in ("stop", DEAD_END_FINISH) or req.params.max_tokens == 1
        if not done:
            first.finished, first.finish_reason = False, None
        first.timing, made = self.ttft_clocks.first_token(rid), time.perf_counter()
        producer = self.producers[req.transfer]
        if not done and producer is not self.nixl:  # the store: the put runs off this loop
            if _token_before_put(req):
                _handover_time(first, made)
                self.control.send(pending.identity, PrefillResult(rid, first=first, handover_follows=True))
            self.puts.start(producer.prepare(pending), first, made)
            return
        if not done and req.push and self.writer is not None and not self.writer.has(rid):
            # Its decode node's WriteTarget has not come: the first token goes now, the handover
            # (with the blocks written) once the target comes (_take_target), or without them.
            _handover_time(first, made)
            self.control.send(pending.identity, PrefillResult(rid, first=first, handover_follows=True))
            self.awaiting[rid] = (pending, time.monotonic())
            return
        handover = None if done else self._made(pending, producer)
        if done:  # no handover: nothing to write, nothing to pin
            if self.writer is not None:
                self.writer.forget(rid)
            self._release(rid)
        _handover_time(first, made)
        self.control.send(pending.identity, PrefillResult(rid, first=first, handover=handover))

    def _made(self, pending: PendingPrefill, producer: Producer) -> KVHandover | None:
        """The handover (a NIXL one with push mode's WRITEs done); None: it failed (recompute)."""
        rid, handover = pending.request.request_id, None
        try:
            handover = producer.hand_over(pending)
            if self.writer is not None and producer is self.nixl:
                handover = self.writer.finish(rid, handover)
        except (KVStoreError, RuntimeError) as exc:
            log.warning("[%s] handover failed, the decode node will recompute: %s", rid, exc)
        if self.writer is not None:
            self.writer.forget(rid)
        if handover is None or not producer.pins_blocks:
            self._release(rid)
        return handover

    def _take_target(self, msg: WriteTarget) -> None:
        rid = msg.request_id
        pending = self.pending.get(rid) or self.awaiting.get(rid, (None,))[0]
        if self.writer is None:
            return
        if pending is None or pending.request.transfer != "nixl":
            return self.writer.decline(msg)
        self.writer.take(msg)
        if self.borrowed.take(msg, self.writer.peer_of(rid)) is not None:
            self.ttft_clocks.landed(rid)
        if rid in self.awaiting:
            self._hand_over_awaited(rid)

    def _hand_over_awaited(self, rid: str) -> None:
        pending, _ = self.awaiting.pop(rid)
        self.control.send(pending.identity, HandoverMade(rid, self._made(pending, self.nixl)))

    def _finish_puts(self) -> None:
        for put, handover in self.puts.finished():
            self._release(put.request_id)
            if not put.aborted and _token_before_put(put.job.pending.request):
                self.control.send(put.job.pending.identity, HandoverMade(put.request_id, handover))
            elif not put.aborted:
                _handover_time(put.first, put.made)
                self.control.send(put.job.pending.identity, PrefillResult(put.request_id, first=put.first,
                                                                          handover=handover))

    def answer_error(self, identity: bytes, msg: Message, error: str) -> None:
        if isinstance(msg, PrefillRequest):
            self._reply_error(identity, msg.request_id, error)  # the router tries another prefill node
        else:
            super().answer_error(identity, msg, error)

    def _reply_error(self, identity: bytes, rid: str, error: str) -> None:
        log.warning("[%s] rejected: %s", rid, error)
        self.control.send(identity, PrefillResult(rid, error=error))

    # ---- freeing handed-over blocks -----------------------------------------------------
    def poll_background(self) -> None:
        if self.writer is not None and self.writer.targets:
            self.writer.advance()  # the whole blocks the last step computed, into their decode node's
        if self.borrowed is not None and self.borrowed.waiting:
            self.borrowed.expire()
        now = time.monotonic()
        for rid in [r for r, (_, since) in self.awaiting.items() if now - since > TARGET_WAIT_S]:
            log.warning("[%s] no WriteTarget in %.0f s: handing over for READs", rid, TARGET_WAIT_S)
            self.target_timeouts += 1
            self._hand_over_awaited(rid)  # its decode node is stuck: pull mode's handover
        if self.puts is not None:
            self._finish_puts()
        for producer in self.producers.values():
            for rid in producer.freed():
                self._release(rid)

    def _release(self, rid: str) -> None:
        self.engine.release_blocks(rid)
        self.origin.pop(rid, None)

    def abort(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.awaiting.pop(request_id, None)
        for producer in self.producers.values():
            producer.forget(request_id)
        if self.writer is not None:
            self.writer.forget(request_id)
            self.borrowed.forget(request_id)
        if self.puts is not None and self.puts.abort(request_id):
            return  # its blocks stay held until its put ends (store_puts)
        super().abort(request_id)

    def role_idle(self) -> bool:
        return (not self.pending and not self.awaiting and (self.puts is None or self.puts.idle())
                and all(producer.idle() for producer in self.producers.values()))

    def close_role(self) -> None:
        self.close_step_budget()
        if self.puts is not None:
            self.puts.close()
        if self.store_prefix is not None:
            self.store_prefix.close()
        if self.writer is not None:
            self.writer.close()
        for producer in self.producers.values():
            producer.close()


def _token_before_put(req: PrefillRequest) -> bool:
    """Whether a store handover's first token goes before its put, the handover after it
    (HandoverMade): push mode (its decode node waits already), or the router asked for it."""
    return req.push or req.put_after_token


def _handover_time(first: StepOutput, made: float) -> None:
    """The first token waited from `made` until its handover was ready (a store put, NIXL pins)."""
    if first.timing is not None:
        first.timing.handover_s = time.perf_counter() - made
