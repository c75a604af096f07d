"""Continuous batching: each step packs decodes and chunked prefills under a token budget.

Running requests go first, in arrival order; when blocks run out the latest-arrived running
request is preempted (its blocks freed, recomputed later). Waiting requests join only in steps
that preempted nothing, so a preempted request is never starved by newcomers.

With LoRA adapters, a waiting request joins only once its adapter holds a slot
(pdserve.lora.manager); while every slot is held by running requests' adapters it waits and
later requests may pass it.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import RemoteKV, Request, RequestStatus


@dataclass
class ScheduledBatch:
    items: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, lora=None):
        self.config = config
        self.kv = kv
        self.lora = lora  # a pdserve.lora.manager.LoRAManager when adapters are on
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.held: dict[str, Request] = {}  # finished, blocks kept for a handover
        # Optional cap on the prompt tokens a step prefills, given its decode rows (a decode node
        # holding its streams' TPOT target sets it: pdserve.protocol.tpot_budget); None: no cap.
        self.prefill_budget: Callable[[int], int | None] | None = None
        self._prefill_left = 0
        self.step_prefill_tokens = 0  # the last step's tokens in prefill chunks (the rest are one-token rows)
        # A vision-language model's images that a range of a request's tokens needs encoded (not
        # in the encoder cache): pdserve.engine.multimodal.MultiModalInputs.uncached_images.
        # Their embeddings count against the step's prefill tokens, one per embedding, so an
        # image is encoded in a step that starts with it rather than on top of a full one.
        self.uncached_images: Callable[[Request, int, int], list] | None = None
        self.step_encoder_tokens = 0  # the last step's embeddings to encode
        # Steps in flight at once (pipeline stages: pdserve.engine.pipelined). A step then takes
        # at most its share of the running requests, so the steps in flight stay about even,
        # and skips those in flight, whose next token is still to come.
        self.steps_in_flight = 1

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def add_remote(self, req: Request, remote: RemoteKV) -> bool:
        """Admit a request whose first remote.num_tokens tokens of KV arrive from elsewhere.
        Allocates their blocks now (prefix-cache hits first); False when the cache is full, in
        which case the request waits as an ordinary local one."""
        cached = self.kv.find_cached_prefix(req)
        num_tokens = max(remote.num_tokens, len(cached) * self.kv.block_size)
        # (A sliding-window model gets no blocks for what the first query after the KV won't see.)
        if not self.kv.allocate_landing(req, num_tokens, cached, horizon=remote.num_tokens):
            self.add(req)
            return False
        req.num_computed_tokens = len(cached) * self.kv.block_size
        req.num_cached_tokens = req.num_computed_tokens
        req.remote_kv = remote
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.add(req)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_work_ready(self) -> bool:
        """Whether a step would compute now: a running request, or a waiting one not waiting for
        remote KV, or whose wait is over (its KV landed, its transfer failed or timed out)."""
        return bool(self.running) or any(r.status != RequestStatus.WAITING_FOR_REMOTE_KVS or _wait_over(r.remote_kv)
                                         for r in self.waiting)

    def longest_prompt_to_compute(self) -> int:
        """The most prompt tokens one running or waiting request has yet to compute (a request
        waiting for remote KV counts none; cached prefixes are found only when scheduled)."""
        ready = [r for r in self.waiting if r.status != RequestStatus.WAITING_FOR_REMOTE_KVS]
        # (a decoding request has computed past its prompt: none left, not a negative count)
        return max((max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in (*self.running, *ready)), default=0)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        cap = self.prefill_budget(self._decode_rows()) if self.prefill_budget is not None else None
        self._prefill_left = budget if cap is None else cap
        self.step_prefill_tokens = self.step_encoder_tokens = 0
        budget = self._schedule_running(batch, budget)
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        i, share = 0, -(-len(self.running) // self.steps_in_flight)
        in_flight = any(r.in_pipeline for r in self.running)
        while i < len(self.running) and budget > 0 and len(batch.items) < share:
            req = self.running[i]
            if req.awaiting_last_token or req.in_pipeline:
                i += 1
                continue
            n = self._take_prefill(req, req.num_computed_tokens, budget)
            if n == 0:  # a prefill chunk past this step's prefill cap: it waits a step
                i += 1
                continue
            while not self.kv.allocate(req, n):
                if in_flight:  # no preempting a request in flight: wait for the steps to come back
                    return 0
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    return budget
            batch.items.append((req, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        held: list[Request] = []
        computing = self._blocks_being_computed() if self.waiting else set()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not self._resolve_remote(req):
                held.append(self.waiting.popleft())
                continue
            if not self._adapter_ready(req):
                held.append(self.waiting.popleft())
                continue
            cached = self.kv.find_cached_prefix(req) if not req.block_ids else []
            if not req.block_ids and self._next_block_key(req, len(cached)) in computing:
                # Another request is computing this prompt's next blocks right now: wait a step
                # and take them from the prefix cache instead of computing them a second time.
                held.append(self.waiting.popleft())
                continue
            n = self._take_prefill(req, req.num_computed_tokens + len(cached) * self.kv.block_size, budget)
            if n == 0:  # past the prefill cap: requests behind it that only decode may still join
                held.append(self.waiting.popleft())
                continue
            if not self.kv.allocate(req, n, cached):
                self._release_adapter(req)
                break
            self.waiting.popleft()
            if cached:
                req.num_computed_tokens = len(cached) * self.kv.block_size
                req.num_cached_tokens = max(req.num_cached_tokens, req.num_computed_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.items.append((req, n))
            budget -= n
            computing.update(self._uncommitted_prompt_keys(req))
        self.waiting.extendleft(reversed(held))

    def _decode_rows(self) -> int:
        return sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1 and not r.awaiting_last_token)

    def _take_prefill(self, req: Request, start: int, budget: int) -> int:
        """Tokens to compute for a request from token `start` on: one (a decode row, or a prompt
        whose KV landed) always fits the step's budget; more is a prefill chunk, within the cap,
        that cuts no image of a model with bidirectional images."""
        remaining = req.num_tokens - start
        n = min(remaining, budget)
        if remaining > 1:
            n = min(n, self._prefill_left)
            if self.kv.whole_images and req.images:
                n = self._whole_images(req, start, n)
            if self.uncached_images is not None and req.images and n > 0:
                n = self._encoder_room(req, start, n)
            if self.kv.snapshots is not None and start + n < req.num_tokens:
                n = self._to_block_boundary(start, n)
            self._prefill_left -= n
            self.step_prefill_tokens += n
        return n

    def _to_block_boundary(self, start: int, n: int) -> int:
        """A hybrid model's prefill chunk cut back to end on a block boundary where it can, so the
        state after it is snapshotted for prefix caching (pdserve.engine.state_snapshots)."""
        end = (start + n) // self.kv.block_size * self.kv.block_size
        return end - start if end > start else n

    def _encoder_room(self, req: Request, start: int, n: int) -> int:
        """n, or cut back to the first image that needs encoding when the chunk and the encoding
        do not both fit what is left of the step's prefill; an image the chunk starts with is
        encoded now, its embeddings charged to the step."""
        images = self.uncached_images(req, start, start + n)
        cost = sum(im.length for im in images)
        if not cost:
            return n
        if images[0].offset > start and n + cost > self._prefill_left:
            return images[0].offset - start
        self._prefill_left = max(self._prefill_left - cost, n)
        self.step_encoder_tokens += cost
        return n

    def _whole_images(self, req: Request, start: int, n: int) -> int:
        """n cut back to the start of an image it would end inside. An image starting at `start`
        that does not fit waits for a step with room, unless no step ever has it (longer than
        max_num_batched_tokens): then it goes whole, past the budget."""
        end = start + n
        for im in req.images:
            if im.offset < end < im.end:
                if im.offset > start:
                    return im.offset - start
                if im.length > self.config.max_num_batched_tokens:
                    return im.end - start
                return 0
        return n

    def _adapter_ready(self, req: Request) -> bool:
        """The request's adapter holds a slot (taken now if need be); False: it must wait."""
        if req.lora_name is None or req.lora_slot is not None:
            return True
        req.lora_slot = self.lora.acquire(req.lora_name)
        return req.lora_slot is not None

    def _release_adapter(self, req: Request) -> None:
        if req.lora_slot is not None:
            self.lora.release(req.lora_slot)
            req.lora_slot = None

    def _uncommitted_prompt_keys(self, req: Request) -> list[bytes]:
        if not self.kv.pool.enable_caching or req.num_computed_tokens >= req.num_prompt_tokens:
            return []
        full = req.num_prompt_tokens // self.kv.block_size
        return self.kv.block_keys(req)[req.num_registered_blocks:full]

    def _blocks_being_computed(self) -> set[bytes]:
        """Keys of prompt blocks that running requests are prefilling and have not cached yet."""
        return {key for req in self.running for key in self._uncommitted_prompt_keys(req)}

    def _next_block_key(self, req: Request, num_cached_blocks: int) -> bytes | None:
        keys = self.kv.block_keys(req)
        return keys[num_cached_blocks] if num_cached_blocks < len(keys) else None

    def _resolve_remote(self, req: Request) -> bool:
        """True once the request may run: its KV landed, its transfer failed or timed out."""
        remote = req.remote_kv
        if not _wait_over(remote):
            return False
        if remote.landed:
            # Keep one token to compute so there are logits to sample from.
            req.num_computed_tokens = max(req.num_computed_tokens, min(remote.num_tokens, req.num_tokens - 1))
            if self.kv.snapshots is not None and req.num_computed_tokens == remote.num_tokens:
                self.kv.commit(req)  # a hybrid's landed state, snapshotted if it ends on a boundary
        # On failure or timeout the request recomputes into the blocks it already holds; one
        # whose leading blocks slid out (never landed) starts again from its prefix cache.
        req.remote_kv = None
        if req.num_slid_blocks or not (remote.landed or self.kv.restore_state(req)):
            self.kv.free(req)
            req.num_computed_tokens = req.num_cached_tokens = 0
        req.status = RequestStatus.WAITING
        return True

    def _preempt(self, req: Request) -> None:
        self.num_preemptions += 1
        self.kv.free(req)
        self._release_adapter(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request in any state, freeing every block it holds (or holding them for a
        handover when the request asked for it and was not aborted)."""
        req.status = status
        self._release_adapter(req)
        if req.lora_name is not None and req.request_id in self.requests:
            self.lora.unref(req.lora_name)
        if req.hold_blocks and status != RequestStatus.FINISHED_ABORTED:
            self.held[req.request_id] = req
        else:
            self.kv.free(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.requests.pop(req.request_id, None)

    def release_held(self, request_id: str) -> bool:
        req = self.held.pop(request_id, None)
        if req is not None:
            self.kv.free(req)
        return req is not None


def _wait_over(remote: RemoteKV) -> bool:
    """A request's wait for its remote KV is over: landed, or failed or timed out with no
    transfer still in flight."""
    return remote.landed or not (remote.in_flight or (not remote.failed and time.monotonic() < remote.deadline))
