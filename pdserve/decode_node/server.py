"""Decode node: admits each request in WAITING_FOR_REMOTE_KVS with its blocks allocated, pulls
the prompt's KV (NIXL READ or store fetch), checks it arrived whole, then decodes it in the
continuous batch and streams tokens back. A failed or late pull never hangs a request: it is
recomputed locally (or failed, if so configured).

A request may carry its inter-token latency target (DecodeRequest.itl_slo_s): while any does,
each step prefills only the prompt tokens the tightest target leaves after the decode rows
(pdserve.node.step_budget), so prompts the router sends here to prefill do not make the running
streams late."""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from pdserve.decode_node.nixl_puller import NixlPuller
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import Request, RequestStatus
from pdserve.kvstore.base import KVStore
from pdserve.kvstore.errors import KVStoreError
from pdserve.node.runtime import NodeRuntime
from pdserve.node.step_budget import StepBudget
from pdserve.wire.messages import DecodeRequest, KVHandover, Message, Ping, Pong, PrefillRequest, Rejected

log = logging.getLogger(__name__)


class DecodeNode(StepBudget):
    role = "decode"

    def __init__(self, engine: LLMEngine, bind: str | NodeRuntime, node_id: str, store: KVStore | None = None,
                 use_nixl: bool = False, on_transfer_failure: str = "recompute", pull_delay_s: float = 0.0):
        super().__init__(engine, bind, node_id)
        self.store = store
        self.on_transfer_failure = on_transfer_failure
        self.pull_delay_s = pull_delay_s  # fault injection for tests: wait before pulling
        self.fetcher = ThreadPoolExecutor(1, thread_name_prefix="kv-fetch") if store is not None else None
        self.fetches: dict[str, Future] = {}
        self.nixl = NixlPuller(node_id, engine.kv_cache, self.ctx) if use_nixl else None
        self.deferred_aborts: set[str] = set()
        # A request resumed here under an id whose aborted pull still runs: admitted when it ends.
        self.resumes_waiting: dict[str, tuple[bytes, DecodeRequest]] = {}
        self.pull_started: dict[str, tuple[str, float, int]] = {}  # rid -> (path, start, bytes)
        self.block_nbytes = engine.kv_cache[0].numel() * engine.kv_cache.element_size()
        self.delayed: list[tuple[float, Request, KVHandover, float]] = []
        self.placements = {"prefills_local": 0, "prefills_handed_over": 0}
        self.init_step_budget()

    def handle(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, PrefillRequest):  # sent before the router saw this node switch roles
            self.control.send(identity, Rejected(msg.request_id, "this node serves decode now"))
            return
        if not isinstance(msg, DecodeRequest):
            log.warning("decode node ignores %s", type(msg).__name__)
            return
        rid, handover = msg.request_id, msg.handover
        if rid in self.deferred_aborts:  # the router resumes it here (no other decode node was up)
            self.resumes_waiting[rid] = (identity, msg)
            return
        pull = msg.pulls_kv()
        try:
            req = self.engine.add_request(rid, msg.prompt_token_ids, msg.params, output_token_ids=msg.first_token_ids,
                                          remote_kv_tokens=handover.num_tokens if pull else 0,
                                          cache_salt=msg.cache_salt, lora_name=msg.adapter)
        except ValueError as exc:
            return self.fail(identity, rid, str(exc))
        self.origin[rid] = identity
        self.stats.requests_total += 1
        self.hold_itl_target(rid, msg.itl_slo_s)
        if pull or not msg.first_token_ids:  # (a stream resumed here after a failover is neither)
            self.placements["prefills_handed_over" if pull else "prefills_local"] += 1
        if pull and req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            # No room for the handed-over blocks: computed here instead; free the sender's now.
            if handover.mode == "nixl" and self.nixl is not None:
                self.nixl.release_remote(handover, rid)
        elif pull:
            now = time.monotonic()
            self.delayed.append((now + self.pull_delay_s, req, handover, now))
            self._start_due_pulls()

    def pong(self, ping: Ping) -> Pong:
        pong = super().pong(ping)
        pong.stats.update(**self.budget_stats(), **self.placements)
        return pong

    def _start_due_pulls(self) -> None:
        now = time.monotonic()
        due = [d for d in self.delayed if d[0] <= now]
        self.delayed = [d for d in self.delayed if d[0] > now]
        for _, req, handover, received_at in due:
            if req.request_id in self.engine.scheduler.requests:
                self._start_pull(req, handover, received_at)

    def _start_pull(self, req: Request, handover: KVHandover, received_at: float) -> None:
        bs = self.engine.config.block_size
        if handover.first_block > req.num_slid_blocks:
            # Blocks this node would keep were not handed over (a differently windowed model?):
            # recompute rather than cache blocks that never landed.
            self._finish_pull(req.request_id, False, handover)
            return
        # Skip the blocks the local prefix cache already had and those out of the window.
        first = max(req.num_computed_tokens // bs, req.num_slid_blocks)
        n_blocks = -(-handover.num_tokens // bs)
        if first >= n_blocks:
            self._finish_pull(req.request_id, True, handover)
            return
        self.pull_started[req.request_id] = (handover.mode, time.perf_counter(),
                                             (n_blocks - first) * self.block_nbytes)
        if handover.mode == "store" and self.fetcher is not None:
            counts = [min(bs, handover.num_tokens - i * bs) for i in range(first, n_blocks)]
            self.engine.mark_remote_transfer(req.request_id)
            self.fetches[req.request_id] = self.fetcher.submit(
                self._fetch, handover.keys[first:n_blocks], req.block_ids[first:n_blocks], counts, first)
        elif handover.mode == "nixl" and self.nixl is not None:
            deadline = req.remote_kv.deadline - time.monotonic()
            ok = self.nixl.start(req.request_id, handover, req.block_ids[:n_blocks], first, received_at, deadline)
            if ok:
                self.engine.mark_remote_transfer(req.request_id)
            else:
                self._finish_pull(req.request_id, False, handover)
        else:
            self._finish_pull(req.request_id, False, handover)

    def _fetch(self, keys: list[bytes], block_ids: list[int], counts: list[int], first: int) -> bool:
        try:
            return self.store.get(keys, self.engine.kv_cache, block_ids, counts, first_block=first) == len(keys)
        except KVStoreError as exc:
            log.warning("store fetch failed: %s", exc)
            return False

    def poll_background(self) -> None:
        if self.delayed:
            self._start_due_pulls()
        for rid in [r for r, f in self.fetches.items() if f.done()]:
            self._finish_pull(rid, self.fetches.pop(rid).result(), None)
        if self.nixl is not None:
            for rid, ok in self.nixl.poll():
                self._finish_pull(rid, ok, None)

    def _finish_pull(self, rid: str, ok: bool, handover: KVHandover | None) -> None:
        if self.nixl is not None and handover is not None and handover.mode == "nixl":
            self.nixl.release_remote(handover, rid)  # nothing was read: let the prefill node free them
        if rid in self.deferred_aborts:
            self.deferred_aborts.discard(rid)
            if ok:  # its client left while the prompt's KV was landing: keep it for the next one
                self.engine.cache_landed_kv(rid)
            super().abort(rid)
            if (waiting := self.resumes_waiting.pop(rid, None)) is not None:
                self.handle(*waiting)
            return
        started = self.pull_started.pop(rid, None)
        if ok:
            self.stats.transfers_ok += 1
            if started is not None:
                self._count_transfer(*started)
        else:
            self.stats.transfers_failed += 1
            log.warning("[%s] KV pull failed: %s", rid, self.on_transfer_failure)
            if self.on_transfer_failure == "fail":
                identity = self.origin.get(rid)
                super().abort(rid)
                if identity is not None:
                    self.fail(identity, rid, "the prompt's KV could not be transferred")
                return
        self.engine.report_remote_kv(rid, ok)

    def _count_transfer(self, path: str, start: float, nbytes: int) -> None:
        if path in ("nixl", "store"):
            setattr(self.stats, f"transfer_bytes_{path}", getattr(self.stats, f"transfer_bytes_{path}") + nbytes)
            setattr(self.stats, f"transfer_us_{path}", getattr(self.stats, f"transfer_us_{path}")
                    + int((time.perf_counter() - start) * 1e6))

    def abort(self, request_id: str) -> None:
        # A pull in flight writes into the request's blocks: free them only once it ends.
        self.resumes_waiting.pop(request_id, None)
        if request_id in self.fetches or (self.nixl is not None and self.nixl.in_flight(request_id)):
            self.deferred_aborts.add(request_id)
            self.origin.pop(request_id, None)
            return
        self.delayed = [d for d in self.delayed if d[1].request_id != request_id]
        super().abort(request_id)

    def role_idle(self) -> bool:
        nixl_busy = self.nixl is not None and bool(self.nixl.pulls)
        return not (self.fetches or self.delayed or self.deferred_aborts or self.resumes_waiting or nixl_busy)

    def close_role(self) -> None:
        self.close_step_budget()
        if self.fetcher is not None:
            self.fetcher.shutdown(wait=True, cancel_futures=True)
        if self.nixl is not None:
            self.nixl.close()
