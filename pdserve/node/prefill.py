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

import zmq

from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import RequestStatus
from pdserve.kvstore.base import KVStore
from pdserve.kvstore.errors import KVStoreError
from pdserve.node.producers import MISSING, NixlProducer, PendingPrefill, Producer, StoreProducer
from pdserve.node.runtime import NodeRuntime
from pdserve.node.step_budget import StepBudget
from pdserve.protocol.block_keys import block_key_chain
from pdserve.protocol.grammar import DEAD_END_FINISH
from pdserve.protocol.outputs import StepOutput
from pdserve.wire.handover import NixlMetadataRequest
from pdserve.wire.messages import (
    DecodeRequest,
    Message,
    Ping,
    Pong,
    PrefillRequest,
    PrefillResult,
    Rejected,
)
from pdserve.wire.transport import NodeSocket

log = logging.getLogger(__name__)


class PrefillNode(StepBudget):
    role = "prefill"

    def __init__(self, engine: LLMEngine, bind: str | NodeRuntime, node_id: str, store: KVStore | None = None,
                 nixl_side_channel: str | None = None, lease_s: float = 30.0, advertise_host: str | None = None):
        super().__init__(engine, bind, node_id)
        self.store = store
        self.pending: dict[str, PendingPrefill] = {}
        self.whole_requests = 0  # requests prefilled and decoded here (the router's fallback)
        self.init_step_budget()
        self.nixl: NixlProducer | None = None
        if nixl_side_channel:
            self.nixl = NixlProducer(engine, node_id, self.ctx, nixl_side_channel, advertise_host, lease_s, self.stats)
            self.poller.register(self.nixl.side.sock, zmq.POLLIN)
        producers = [StoreProducer(engine, store, self.stats)] if store is not None else []
        # By the transport a request names.
        self.producers: dict[str, Producer] = {p.transport: p for p in [*producers, self.nixl] if p is not None}

    def socket_for(self, raw) -> NodeSocket:
        return self.nixl.side if self.nixl is not None and raw is self.nixl.side.sock else self.control

    # ---- requests -------------------------------------------------------------------------
    def handle(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, NixlMetadataRequest) and self.nixl is not None:
            self.nixl.side.send(identity, self.nixl.metadata())
        elif isinstance(msg, PrefillRequest):
            self._admit(identity, msg)
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
        bs = self.engine.config.block_size
        salt = self.engine.request_salt(req.cache_salt, req.adapter)  # a tenant's blocks are its own
        keys = block_key_chain(req.prompt_token_ids, bs, salt, include_partial=True, images=req.images)
        try:
            # Full blocks before the last token only: that token is computed for its logits.
            stored = self._store_prefix_tokens(keys[:(len(req.prompt_token_ids) - 1) // bs])
            engine_req = self.engine.add_request(rid, req.prompt_token_ids, params, hold_blocks=True,
                                                 remote_kv_tokens=stored,
                                                 continues_elsewhere=req.params.max_tokens > 1,
                                                 cache_salt=req.cache_salt, lora_name=req.adapter,
                                                 images=req.images)
        except ValueError as exc:
            return self._reply_error(identity, rid, str(exc))
        if stored and engine_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            # (When the cache had no room for the stored blocks the request just computes.)
            local = engine_req.num_computed_tokens
            if self._load_prefix_from_store(engine_req, keys[:stored // bs]):
                engine_req.num_cached_tokens = max(engine_req.num_cached_tokens, stored)
                self.stats.cached_tokens_store += max(stored - local, 0)
        self.pending[rid] = PendingPrefill(identity, req, keys, stored)
        # Until its blocks are free: a router that goes silent takes its prefills and leases with it.
        self.origin[rid] = identity
        self.stats.requests_total += 1

    def _admit_whole(self, identity: bytes, msg: DecodeRequest) -> None:
        """Prefill and decode the request here, streaming its tokens as a decode node does."""
        rid = msg.request_id
        self.take_embeddings(msg.images)
        try:
            self.engine.add_request(rid, msg.prompt_token_ids, msg.params, output_token_ids=msg.first_token_ids,
                                    cache_salt=msg.cache_salt, lora_name=msg.adapter, images=msg.images)
        except ValueError as exc:
            return self.fail(identity, rid, str(exc))
        self.origin[rid] = identity
        self.stats.requests_total += 1
        self.whole_requests += 1
        self.hold_itl_target(rid, msg.itl_slo_s)

    def _store_prefix_tokens(self, keys: list[bytes]) -> int:
        """Tokens of the leading blocks found in the shared store (reused, not recomputed)."""
        if self.store is None or not keys:
            return 0
        try:
            return self.store.lookup_prefix(keys) * self.engine.config.block_size
        except KVStoreError as exc:
            log.warning("store lookup failed, computing the whole prompt: %s", exc)
            return 0

    def _load_prefix_from_store(self, req, keys: list[bytes]) -> bool:
        bs = self.engine.config.block_size
        # Blocks already cached locally need no fetch; slid-out ones (out of every layer's
        # window) are not held at all.
        first = max(req.num_computed_tokens // bs, req.num_slid_blocks)
        keys = keys[first:]
        ids = req.block_ids[first:first + len(keys)]
        t0 = time.perf_counter()
        try:
            loaded = self.store.get(keys, self.engine.kv_cache, ids, [bs] * len(keys), first_block=first)
        except KVStoreError as exc:
            log.warning("[%s] store fetch failed: %s", req.request_id, exc)
            loaded = -1
        self.stats.store_load_us += int((time.perf_counter() - t0) * 1e6)
        ok = loaded == len(keys)
        self.engine.report_remote_kv(req.request_id, ok=ok)
        return ok

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            pending = self.pending.pop(out.request_id, None)
            if pending is not None:
                self._hand_over(pending, out)
            else:  # a whole request
                self.reply_delta(out)

    def pong(self, ping: Ping) -> Pong:
        pong = super().pong(ping)
        pong.stats.update(**self.budget_stats(), whole_requests=self.whole_requests, serves_whole=1)
        return pong

    def _hand_over(self, pending: PendingPrefill, first: StepOutput) -> None:
        req = pending.request
        rid = req.request_id
        done = first.finish_reason in ("stop", DEAD_END_FINISH) or req.params.max_tokens == 1
        if not done:
            first.finished, first.finish_reason = False, None
        producer, handover = self.producers[req.transfer], None
        try:
            if not done:
                handover = producer.hand_over(pending)
        except (KVStoreError, RuntimeError) as exc:
            log.warning("[%s] handover failed, the decode node will recompute: %s", rid, exc)
        if handover is None or not producer.pins_blocks:
            self._release(rid)
        self.control.send(pending.identity, PrefillResult(rid, first=first, handover=handover))

    def _reply_error(self, identity: bytes, rid: str, error: str) -> None:
        log.warning("[%s] rejected: %s", rid, error)
        self.control.send(identity, PrefillResult(rid, error=error))

    # ---- freeing handed-over blocks -----------------------------------------------------
    def poll_background(self) -> None:
        for producer in self.producers.values():
            for rid in producer.freed():
                self._release(rid)

    def _release(self, rid: str) -> None:
        self.engine.release_blocks(rid)
        self.origin.pop(rid, None)

    def abort(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        for producer in self.producers.values():
            producer.forget(request_id)
        super().abort(request_id)

    def role_idle(self) -> bool:
        return not self.pending and all(producer.idle() for producer in self.producers.values())

    def close_role(self) -> None:
        self.close_step_budget()
        for producer in self.producers.values():
            producer.close()
