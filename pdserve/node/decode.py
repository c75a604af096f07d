"""Decode node: admits each request in WAITING_FOR_REMOTE_KVS with its blocks allocated, pulls
the prompt's KV (NIXL READ or store fetch, pdserve.node.pullers), checks it arrived whole, then
decodes it in the continuous batch and streams tokens back. A failed or late pull never hangs a
request: it is recomputed locally (or failed, if so configured).

A request whose KV is pulled has one entry in `pulls` while the pull is not over, in one of the
PullState states below; once its pull ends the engine has it as any other request.

A request may carry its inter-token latency target (DecodeRequest.itl_slo_s): while any does,
each step prefills only the prompt tokens the tightest target leaves after the decode rows
(pdserve.node.step_budget), so prompts the router sends here to prefill do not make the running
streams late."""
from __future__ import annotations

import logging
import time

from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import Request, RequestStatus
from pdserve.kvstore.base import KVStore
from pdserve.node.pull_record import Pull, PullState
from pdserve.node.pullers import NixlPuller, Puller, StorePuller
from pdserve.node.push_intake import PushIntake
from pdserve.node.runtime import NodeRuntime
from pdserve.node.step_budget import StepBudget
from pdserve.node.store_prefetch import StorePrefetch
from pdserve.node.store_prefix import StorePrefix, request_block_keys
from pdserve.node.store_writeback import StoreWriteBack
from pdserve.wire.handover import KVHandover, NixlHandover, StoreHandover
from pdserve.wire.messages import (
    DecodeRequest,
    KVReady,
    Message,
    Ping,
    Pong,
    PrefillRequest,
    PrefixLoaded,
    Rejected,
    WriteTarget,
)

log = logging.getLogger(__name__)


class DecodeNode(StepBudget):
    role = "decode"

    def __init__(self, engine: LLMEngine, bind: str | NodeRuntime, node_id: str, store: KVStore | None = None,
                 use_nixl: bool = False, on_transfer_failure: str = "recompute", pull_delay_s: float = 0.0,
                 prefetch_stored_prefix: bool = False):
        super().__init__(engine, bind, node_id)
        self.store = store
        self.on_transfer_failure = on_transfer_failure
        self.pull_delay_s = pull_delay_s  # fault injection for tests: wait before pulling
        pullers: list[Puller] = []
        if store is not None:
            pullers.append(StorePuller(store, engine.kv_cache, engine.config.block_size, engine.kv.states))
        if use_nixl:
            pullers.append(NixlPuller(node_id, engine.kv_cache, self.ctx, engine.salt, engine.kv.states))
        self.pullers = {p.handover_type: p for p in pullers}
        self.store_prefix = StorePrefix(engine, store, self.stats) if store is not None else None  # by the type of handover each pulls
        self.writeback = StoreWriteBack(engine, store, self.stats) if store is not None else None
        self.pulls: dict[str, Pull] = {}  # request id -> its pull, until the pull is over
        self.streams: dict[str, Request] = {}  # with a store: the streams whose answers it is sent
        self.block_nbytes = engine.kv_cache[0].numel() * engine.kv_cache.element_size()
        # prefills_pushed: requests admitted before their prompt was computed (push mode)
        self.placements = {"prefills_local": 0, "prefills_handed_over": 0, "prefills_pushed": 0}
        self.push = PushIntake(self)  # push-mode requests waiting for their first token and handover
        self.prefetch = StorePrefetch(self, prefetch_stored_prefix)  # their stored prefixes, meanwhile
        self.init_step_budget()

    def pull_state(self, request_id: str) -> PullState | None:
        pull = self.pulls.get(request_id)
        return None if pull is None else pull.state

    def handle(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, PrefillRequest):  # sent before the router saw this node switch roles
            self.control.send(identity, Rejected(msg.request_id, "this node serves decode now"))
            return
        if isinstance(msg, KVReady):
            return self.push.ready(msg)
        if isinstance(msg, PrefixLoaded):
            return self.prefetch.prefix_loaded(msg.request_id)
        if not isinstance(msg, DecodeRequest):
            log.warning("decode node ignores %s", type(msg).__name__)
            return
        rid = msg.request_id
        if self.pull_state(rid) is PullState.ABANDONED:
            self.pulls[rid].resume = (identity, msg)
            return
        if msg.push:
            return self.push.admit(identity, msg)
        handed_over = msg.pulls_kv()
        handover = msg.handover if handed_over else self._stored_prefix(msg)
        if not handed_over:
            self.take_embeddings(msg.images)  # it computes the prompt here: an encoder node's, if any
        try:
            req = self.engine.add_request(rid, msg.prompt_token_ids, msg.params, output_token_ids=msg.first_token_ids,
                                          remote_kv_tokens=handover.num_tokens if handover is not None else 0,
                                          cache_salt=msg.cache_salt, lora_name=msg.adapter, images=msg.images)
        except ValueError as exc:
            return self.fail(identity, rid, str(exc))
        self.origin[rid] = identity
        self.ttft_clocks.admit(req)
        if self.writeback is not None:
            self.streams[rid] = req  # its answer's blocks go to the store when it ends
        self.stats.requests_total += 1
        self.hold_itl_target(rid, msg.itl_slo_s)
        if handed_over or not msg.first_token_ids:  # (a stream resumed here after a failover is neither)
            self.placements["prefills_handed_over" if handed_over else "prefills_local"] += 1
        if handover is not None:
            self._admit_pull(req, handover, store_prefix=not handed_over)

    def admit_pushed(self, identity: bytes, msg: DecodeRequest, ready: KVReady) -> None:
        """A push-mode request's first token and handover came (node.push_intake): its blocks
        are allocated already, so its pull starts now; with no handover it computes its prompt."""
        rid, handover = msg.request_id, ready.handover
        if self.prefetch.park(identity, msg, ready):
            return  # its stored prefix is loading: admitted once that ends (the pull goes on from there)
        req = self.engine.continue_remote(rid, ready.first_token_ids)
        if req is None:
            if handover is not None:
                self.release_sender(handover, rid)
            return
        self.ttft_clocks.admit(req)  # its wait for the KV starts now
        if self.writeback is not None:
            self.streams[rid] = req
        self.stats.requests_total += 1
        self.hold_itl_target(rid, msg.itl_slo_s)
        if handover is None or handover.num_tokens == 0 or not ready.first_token_ids:
            self.placements["prefills_local"] += not ready.first_token_ids
            return self.engine.report_remote_kv(rid, False)  # computed here, into its blocks
        self.placements["prefills_handed_over"] += 1
        self._admit_pull(req, handover, store_prefix=False)

    def write_target(self, rid: str, req: Request | None, lease_s: float, lend_from_tokens: int = -1
                     ) -> WriteTarget | None:
        """Where a prefill node may WRITE the blocks a push-mode request waits with (req: None when
        it has none); no regions: nothing to write (none lacking, no room, a hybrid model's state),
        said so that its handover need not wait for this. None: this node has no NIXL agent.
        lend_from_tokens >= 0: the blocks this node holds after that many tokens are lent too
        (node.borrowed_prefix), for the prefill node to READ instead of compute."""
        puller, bs = self.pullers.get(NixlHandover), self.engine.config.block_size
        if not isinstance(puller, NixlPuller):
            return None
        n_blocks = 0 if req is None or req.state_slot is not None else -(-len(req.prompt_token_ids) // bs)
        first = min(0 if req is None else max(req.num_computed_tokens // bs, req.num_slid_blocks), n_blocks)
        lend_from = first if lend_from_tokens < 0 or req is None else max(lend_from_tokens // bs, req.num_slid_blocks)
        return puller.write_target(rid, req.block_ids[:n_blocks] if req else [], first, lease_s, min(lend_from, first))

    def _stored_prefix(self, msg: DecodeRequest) -> StoreHandover | None:
        """A prompt this node computes itself fetches the leading blocks the store holds and its
        own cache lacks, through its store puller as it fetches a handover (its streams do not
        wait for the load); once computed, the blocks the store lacks are written there."""
        if self.store_prefix is None or msg.first_token_ids:
            return None  # (a stream resumed after a failover recomputes, as it always did)
        keys = request_block_keys(self.engine, msg.prompt_token_ids, msg.cache_salt, msg.adapter, msg.images)
        full = (len(msg.prompt_token_ids) - 1) // self.engine.config.block_size
        if all(self.engine.pool.lookup(key) is not None for key in keys[:full]):
            return None  # all in this node's cache already (and so written, or handed over, before)
        stored = self.store_prefix.stored_tokens(keys, len(msg.prompt_token_ids))
        self.writeback.owe(msg.request_id, keys, len(msg.prompt_token_ids), stored)
        return self.store_prefix.handover(keys, stored) if stored else None

    def _admit_pull(self, req: Request, handover: KVHandover, store_prefix: bool) -> None:
        if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            if not store_prefix:  # no room for the handed-over blocks: computed here; free the sender's now
                self.release_sender(handover, req.request_id)
            return
        now = time.monotonic()
        self.pulls[req.request_id] = Pull(PullState.DELAYED, req, handover, now, due=now + self.pull_delay_s,
                                          store_prefix=store_prefix)
        self._start_due_pulls()

    def pong(self, ping: Ping) -> Pong:
        pong = super().pong(ping)
        pong.stats.update(**self.budget_stats(), **self.placements, reads_store=int(self.store_prefix is not None))
        return pong

    def kv_readers(self) -> list[object]:
        return list(self.pullers.values())

    def release_sender(self, handover: KVHandover, rid: str) -> None:
        if (puller := self.pullers.get(type(handover))) is not None:
            puller.release(handover, rid)

    def _start_due_pulls(self) -> None:
        now = time.monotonic()
        due = [p for p in self.pulls.values() if p.state is PullState.DELAYED and p.due <= now]
        for pull in due:
            rid = pull.req.request_id
            del self.pulls[rid]
            if rid not in self.engine.scheduler.requests:
                continue
            if pull.req.remote_kv is None:  # its deadline passed meanwhile: the engine recomputes it
                self.release_sender(pull.handover, rid)
            else:
                self._start_pull(pull)

    def _start_pull(self, pull: Pull) -> None:
        req, handover, bs = pull.req, pull.handover, self.engine.config.block_size
        if handover.first_block > req.num_slid_blocks:
            # Blocks this node would keep were not handed over (a differently windowed model?):
            # recompute rather than cache blocks that never landed.
            return self._end_unstarted(pull, False)
        # Skip the blocks the local prefix cache already had and those out of the window.
        first = max(req.num_computed_tokens // bs, req.num_slid_blocks)
        n_blocks = -(-handover.num_tokens // bs)
        # A hybrid model's state is pulled with the blocks, unless the local prefix cache reached
        # as far (its snapshot restored the slot).
        if first >= n_blocks and (req.state_slot is None or req.num_computed_tokens >= handover.num_tokens):
            return self._end_unstarted(pull, True)
        puller = self.pullers.get(type(handover))
        started = time.perf_counter()
        if puller is None or not puller.start(req.request_id, handover, req.block_ids[:n_blocks], first,
                                              pull.received_at, req.remote_kv.deadline - time.monotonic(),
                                              req.state_slot):
            return self._end_unstarted(pull, False)
        self.engine.mark_remote_transfer(req.request_id)
        pull.state, pull.path, pull.started = PullState.PULLING, puller.path, started
        pull.nbytes = (n_blocks - first) * self.block_nbytes
        pull.written = req.request_id in getattr(puller, "written", ())
        pull.state_nbytes = 0 if req.state_slot is None else self.engine.kv.states.slot_nbytes
        pull.unowed = first < getattr(handover, "put_from", 0)
        self.pulls[req.request_id] = pull

    def _end_unstarted(self, pull: Pull, ok: bool) -> None:
        """A pull that needs no fetch (ok) or cannot start. A stored prefix that cannot load is
        computed here whatever --on-transfer-failure says: no peer owed it."""
        if pull.store_prefix:
            self.engine.report_remote_kv(pull.req.request_id, ok)
        else:
            self._finish_pull(pull.req.request_id, ok, release=pull.handover)

    def on_outputs(self, outputs: list) -> None:
        if self.writeback is not None and self.writeback.owed:
            for out in outputs:  # a prompt computed here: its first token is out
                self.writeback.prompt_done(out.request_id)
        if self.streams:
            for out in outputs:
                if out.finished:
                    self._write_answer(out)
        super().on_outputs(outputs)

    def _write_answer(self, out) -> None:
        """Its answer's full blocks (the last token's KV was never computed) go to the store."""
        req = self.streams.pop(out.request_id, None)
        if req is None or out.finish_reason not in ("stop", "length"):
            return
        tokens = req.prompt_token_ids + req.output_token_ids[:-1]
        keys = request_block_keys(self.engine, tokens, req.cache_salt, req.lora_name, req.images)
        bs = self.engine.config.block_size
        self.writeback.answer_done(req.request_id, keys[:len(tokens) // bs], len(req.prompt_token_ids) // bs)

    def poll_background(self) -> None:
        if self.push.waits or self.push.granted:
            self.push.expire()
            if isinstance(nixl := self.pullers.get(NixlHandover), NixlPuller):
                self.push.writes_done(nixl.writes_done())
        if self.writeback is not None:
            self.writeback.poll()
        if self.pulls:
            self._start_due_pulls()
        for puller in self.pullers.values():
            for rid, ok in puller.poll():
                self._finish_pull(rid, ok)

    def _finish_pull(self, rid: str, ok: bool, release: KVHandover | None = None) -> None:
        """The pull ended (or never started: then `release` lets the sender free the blocks)."""
        if release is not None:
            self.release_sender(release, rid)
        pull = self.pulls.pop(rid, None)
        if pull is not None and pull.state is PullState.ABANDONED:
            if ok and not pull.prefetch:  # its client left while the prompt's KV was landing: keep it for the next one
                self.engine.cache_landed_kv(rid)
            super().abort(rid)
            if pull.resume is not None:
                self.handle(*pull.resume)
            return
        if pull is not None and pull.prefetch:
            return self.prefetch.finished(pull, ok)
        if pull is not None and pull.store_prefix:
            return self._finish_store_prefix(pull, ok)
        if ok:
            self.stats.transfers_ok += 1
            self.ttft_clocks.landed(rid)
            if pull is not None:
                self._count_transfer(pull)
        else:
            self.stats.transfers_failed += 1
            log.warning("[%s] KV pull failed: %s", rid, self.on_transfer_failure)
            if self.on_transfer_failure == "fail" and not (pull is not None and pull.unowed):
                identity = self.origin.get(rid)
                super().abort(rid)
                if identity is not None:
                    self.fail(identity, rid, "the prompt's KV could not be transferred")
                return
        self.engine.report_remote_kv(rid, ok)

    def _finish_store_prefix(self, pull: Pull, ok: bool) -> None:
        """A stored prefix that did not land is computed here: it was never owed by a peer."""
        if ok:
            self.ttft_clocks.landed(pull.req.request_id)
            self.store_prefix.count_loaded(pull.nbytes // self.block_nbytes * self.engine.config.block_size)
            self.stats.store_load_us += int((time.perf_counter() - pull.started) * 1e6)
        else:
            log.info("[%s] stored prefix did not load: computing it", pull.req.request_id)
        self.engine.report_remote_kv(pull.req.request_id, ok, cached_tokens=pull.handover.num_tokens)

    def _count_transfer(self, pull: Pull) -> None:
        bytes_name, us_name = f"transfer_bytes_{pull.path}", f"transfer_us_{pull.path}"
        if pull.written:  # landed by the prefill node's WRITEs (push mode): nothing was READ
            bytes_name = "transfer_bytes_nixl_written"
            self.pullers[NixlHandover].written.discard(pull.req.request_id)
        setattr(self.stats, bytes_name, getattr(self.stats, bytes_name) + pull.nbytes + pull.state_nbytes)
        setattr(self.stats, us_name, getattr(self.stats, us_name) + int((time.perf_counter() - pull.started) * 1e6))

    def abort(self, request_id: str) -> None:
        if self.push.forget(request_id):
            return  # its blocks wait for the writes to end (push_intake: fenced)
        self.streams.pop(request_id, None)
        self.prefetch.forget(request_id)
        pull = self.pulls.get(request_id)
        if pull is not None and pull.state is not PullState.DELAYED:
            # A pull in flight writes into the request's blocks: free them only once it ends.
            pull.state, pull.resume = PullState.ABANDONED, None
            self.origin.pop(request_id, None)
            return
        self.pulls.pop(request_id, None)
        if self.writeback is not None:
            self.writeback.forget(request_id)
        super().abort(request_id)

    def role_idle(self) -> bool:
        return not self.pulls and not self.push.waits and not self.push.fenced and (self.writeback is None or self.writeback.idle())

    def close_role(self) -> None:
        self.close_step_budget()
        if self.store_prefix is not None:
            self.store_prefix.close()
        if self.writeback is not None:
            self.writeback.close()
        for puller in self.pullers.values():
            puller.close()
