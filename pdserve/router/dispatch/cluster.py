"""The per-request flow over the cluster: prefill -> handover -> decode, relayed as one token
stream, with failover.

A request survives any single node failure:
  * prefill node dies or errors: the prefill is retried on another prefill node, or, with none
    left, the decode node prefills the prompt itself;
  * decode node dies mid-stream: the request resumes on another decode node, which is sent the
    prompt plus every token already relayed as its prefix and continues from the next position
    (seeded draws depend on seed and output position, so the output is the same);
each within a bounded retry budget, after which the client gets a clean error.

Where the request runs is decided once, by placement.Placement.place; the prefill phase is
prefill.PrefillDispatch's, embeddings are embeddings.EmbeddingDispatch's, and what the nodes send
back reaches the waiting requests through node_events.NodeEvents and inflight.Inflight. The
router's main builds all of these and hands them in.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

from pdserve.protocol.multimodal import ImageInput
from pdserve.protocol.outputs import StepOutput
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.router.dispatch.adapters import RouterAdapters
from pdserve.router.dispatch.backend import BackendError
from pdserve.router.dispatch.drain import DrainTracker
from pdserve.router.dispatch.embeddings import EmbeddingDispatch
from pdserve.router.dispatch.encode import EncodeDispatch
from pdserve.router.dispatch.failover import MAX_ATTEMPTS, NodeLost
from pdserve.router.dispatch.health_report import HealthReport
from pdserve.router.dispatch.inflight import Inflight, Lost
from pdserve.router.dispatch.metrics import RequestTimer, RouterMetrics
from pdserve.router.dispatch.node_view import end_whole, node_view, queue_local, unqueue_local
from pdserve.router.dispatch.nodes import Node, NodePool
from pdserve.router.dispatch.picker import NodePicker
from pdserve.router.dispatch.prefill import PrefillDispatch
from pdserve.router.placement.index import STORE_HOLDER
from pdserve.router.placement.keys import KVScope
from pdserve.router.placement.pd_decision import Targets
from pdserve.router.placement.placement import DecodePin, Placement, PlacementDecision, PlacementRequest
from pdserve.wire.embedding_handover import EmbeddingHandover
from pdserve.wire.handover import KVHandover, NixlHandover, StoreHandover, handover_path
from pdserve.wire.messages import Abort, DecodeRequest, EmbedResult, KVReady

log = logging.getLogger(__name__)
TOKEN_TIMEOUT_S = 300.0  # a healthy node that sends nothing for this long still fails the request
MAX_PLANNED_MOVES = 16  # a stream moved off this many draining nodes counts further moves as failures


@dataclasses.dataclass(frozen=True)
class Dispatchers:
    """What the cluster backend dispatches through, built by the router's main."""
    pool: NodePool
    inflight: Inflight
    picker: NodePicker
    prefill: PrefillDispatch
    embeddings: EmbeddingDispatch
    encode: EncodeDispatch
    drains: DrainTracker
    report: HealthReport


class ClusterBackend:
    """GenerationBackend over prefill and decode nodes (with no prefill node, each request runs
    whole on a decode node, the monolithic mode)."""

    def __init__(self, dispatch: Dispatchers, placement: Placement, adapters: RouterAdapters, metrics: RouterMetrics,
                 handover: str = "pull"):
        self.dispatch = dispatch
        # "push": a request prefilled remotely goes to its decode node at once, beside the prompt
        # to its prefill node, so that node allocates and waits while the prompt computes
        self.handover_mode = handover
        self.pool = dispatch.pool
        self.nodes = dispatch.pool.nodes  # the pool's live list
        self.inflight = dispatch.inflight
        self.placement = placement
        self.planner = placement.planner
        self.index = placement.planner.index
        self.block_keys = placement.block_keys  # block_keys(token_ids, scope): as the nodes compute them
        self.adapters = adapters  # LoRA adapters served (pdserve.router.dispatch.adapters)
        self.metrics = metrics
        # placed_*: where placement had prompts prefilled; decode_resumes: streams moved to another node
        self.counters = {"decode_resumes": 0, "placed_remote": 0, "placed_local": 0, "placed_whole": 0}

    @property
    def targets(self) -> Targets | None:
        """The router's default TTFT/ITL targets."""
        return self.placement.targets

    async def start(self) -> None:
        await self.pool.start()

    async def stop(self) -> None:
        self.dispatch.drains.cancel()
        await self.pool.stop()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       session: str | None = None, targets: Targets | None = None, cache_salt: str | None = None,
                       adapter: str | None = None, images: tuple[ImageInput, ...] = (),
                       pin: DecodePin | None = None) -> AsyncIterator[StepOutput]:
        """targets: this request's TTFT/ITL targets (the body's ttft_slo_ms/itl_slo_ms), else the router's.
        images: a vision-language prompt's (pdserve.protocol.multimodal), in its KV scope.
        pin: a decode node requests share (placement.DecodePin): set to the node that decodes this one."""
        if not self.adapters.begin(adapter):
            raise BackendError(f"LoRA adapter {adapter!r} was unloaded")
        self.inflight.open_stream(request_id)
        scope = KVScope(cache_salt, adapter, tuple(images))
        timer = RequestTimer(self.metrics, len(prompt_token_ids))
        relayed: list[int] = []  # every token id the client has been sent, in order
        reason = "abort"  # unless the stream reaches its end
        stage = "queued"  # where an abort (a client gone) found it, for /metrics
        decision = pushed = None
        try:
            request = PlacementRequest(request_id, prompt_token_ids, params.max_tokens, session, targets, scope, pin)
            decision = await self._place(request)
            stage = "prefill"
            # E/P/D: an encoder node's embeddings, when one is up (over NIXL: where they wait)
            embeddings = await self.dispatch.encode.encode(request_id, scope.images) if scope.images else []
            lend_from = self._lend_from(decision)
            pushed = (await self._push(request, params, decision, lend_from)
                      if self._pushes(request, params, decision) else None)
            first, handover = await self._prefill(request, params, timer, decision, embeddings, pushed is not None,
                                                  decode_lends=pushed is not None and lend_from >= 0)
            if first is not None:
                reason = first.finish_reason if first.finished else reason
                stage = "handover"
                if first.finished and pushed is not None:  # (before the yield: the consumer may stop at it)
                    await self._drop_push(pushed, request_id)
                yield first
                relayed += first.new_token_ids
                if first.finished:
                    return
                if handover is None and self.dispatch.prefill.follows(request_id):  # a store put's, say
                    handover = self._handed_over(await self.dispatch.prefill.follow(request_id))
                # The prompt logprobs came with the first token: the decode node owes none.
                params = dataclasses.replace(params, prompt_logprobs=None)
            async for out in self._decode_with_resume(request, params, relayed, handover, timer, decision, pushed):
                self._unqueue_local(decision.plan.decode, request_id)
                timer.tokens(len(out.new_token_ids), out.num_cached_tokens, out.timing)
                reason = out.finish_reason if out.finished else reason
                stage = "decode"
                yield out
        except BackendError:
            reason = "error"
            self.metrics.errors.labels("backend").inc()
            raise
        finally:
            if reason == "abort":
                self.metrics.aborts.labels(stage).inc()
            if pushed is not None:  # (ended before its KVReady went)
                pushed.pushed.discard(request_id)
            self._end(request_id, timer, reason, decision, adapter)

    def _end(self, rid: str, timer: RequestTimer, reason: str, decision: PlacementDecision | None,
             adapter: str | None) -> None:
        timer.finished(reason)
        self.inflight.close_stream(rid)
        self.dispatch.prefill.forget(rid)
        if decision is not None:
            node = self.pool.get(decision.plan.decode)
            if node is not None:
                unqueue_local(node, rid)
                end_whole(node, rid)
        self.adapters.end(adapter)

    async def _place(self, request: PlacementRequest) -> PlacementDecision:
        if not self.pool.by_role("decode"):
            await self.dispatch.picker.await_node("decode")
        adapter = request.scope.adapter
        views = {role: [node_view(n, self.adapters.cost(n.node_id, adapter)) for n in self.pool.by_role(role)]
                 for role in ("decode", "prefill")}
        if not views["decode"]:
            raise BackendError("no healthy decode node")
        decision = self.placement.place(request, views["decode"], views["prefill"])
        if views["prefill"]:
            self.counters[f"placed_{decision.where}"] += 1
        return decision

    async def _prefill(self, request: PlacementRequest, params: SamplingParams, timer: RequestTimer,
                       decision: PlacementDecision, embeddings: list[EmbeddingHandover] | None = None,
                       pushed: bool = False, decode_lends: bool = False) -> tuple[StepOutput | None, KVHandover | None]:
        """The first token and the handover from the prefill node placement chose; (None, None)
        when the decode node prefills the prompt (placed there, or no prefill node could).
        decode_lends: the pushed decode node lends its blocks past the prefill node's (_lend_from)."""
        rid, plan = request.request_id, decision.plan
        if plan.prefill is None:
            self.metrics.handovers.labels("local").inc()
            node = self.pool.get(plan.decode)
            if node is not None:
                queue_local(node, rid, len(request.prompt) - plan.decode_cached_tokens)
            return None, None
        first, handover = await self.dispatch.prefill.prefill(rid, request.prompt, params, timer, plan.prefill,
                                                              request.scope, embeddings, plan.decode_cached_tokens,
                                                              push=pushed, decode_lends=decode_lends)
        if first is not None:
            timer.tokens(len(first.new_token_ids), first.num_cached_tokens, first.timing)
            if not self.dispatch.prefill.follows(rid):  # (else it follows: counted then)
                self._handed_over(handover)
        return first, handover

    def _handed_over(self, handover: KVHandover | None) -> KVHandover | None:
        if isinstance(handover, StoreHandover):
            self.index.add(STORE_HOLDER, handover.keys)  # any prefill node can load these now
        self.metrics.handovers.labels(handover_path(handover)).inc()
        return handover

    def _pushes(self, request: PlacementRequest, params: SamplingParams, decision: PlacementDecision) -> bool:
        """Push mode for this request: prefilled remotely, and nothing its decode node would need
        the first token or the prompt's logits for before the KV lands (prompt logprobs, a
        grammar to replay, images)."""
        return (self.handover_mode == "push" and decision.plan.prefill is not None and not request.scope.images
                and params.prompt_logprobs is None and params.structured is None)

    async def _push(self, request: PlacementRequest, params: SamplingParams, decision: PlacementDecision,
                    lend_from: int) -> Node | None:
        """Send the decode node the request now, to wait for its KV while the prompt computes (and
        lend its blocks past lend_from's tokens where that is not -1); None when its node is not up
        (the request then goes there, or elsewhere, in pull mode)."""
        rid, scope = request.request_id, request.scope
        node = self.dispatch.picker.preferred(decision.plan.decode, set())
        if node is None:
            return None
        if request.pin is not None:
            request.pin.node_id = node.node_id
        self.inflight.assign(rid, node)
        node.pushed.add(rid)  # (a decode row once its KVReady goes: node_view)
        await self.adapters.send_ahead(node, scope.adapter)
        await self.pool.send(node, DecodeRequest(rid, request.prompt, params, itl_slo_s=decision.itl_target_s,
                                                 cache_salt=scope.cache_salt, adapter=scope.adapter, push=True,
                                                 lend_from_tokens=lend_from))
        return node

    def _lend_from(self, decision: PlacementDecision) -> int:
        """Over NIXL, where the decode node holds a whole block more of the prompt than the prefill
        node (a conversation's last answer, which only it computed): the prefill node's tokens,
        after which the decode node lends its blocks to be READ instead of computed; else -1."""
        plan = decision.plan
        more = plan.decode_cached_tokens - plan.prefill_cached_tokens
        return (plan.prefill_cached_tokens if self.dispatch.prefill.transfer == "nixl"
                and more >= self.planner.block_size else -1)

    async def _drop_push(self, node: Node, rid: str) -> None:
        """The first token ended the request: its decode node waits for a token it will not get."""
        await self.pool.send(node, Abort(rid))
        node.requests.discard(rid)

    def _unqueue_local(self, node_id: str, rid: str) -> None:
        node = self.pool.get(node_id)
        if node is not None:
            unqueue_local(node, rid)

    async def _decode_with_resume(self, request: PlacementRequest, params: SamplingParams, relayed: list[int],
                                  handover: KVHandover | None, timer: RequestTimer,
                                  decision: PlacementDecision, pushed: Node | None = None
                                  ) -> AsyncIterator[StepOutput]:
        """pushed: the decode node a push-mode request waits on (_push), sent its first token and
        handover first; lost meanwhile, the request goes to another node in pull mode."""
        rid, scope = request.request_id, request.scope
        queue = self.inflight.streams[rid]
        tried: set[str] = set()
        failures = moves = 0  # planned moves off draining nodes are bounded apart from failures
        while failures < MAX_ATTEMPTS:
            if pushed is not None:
                node, pushed = pushed, None
                tried.add(node.node_id)
                if self.inflight.owner.get(rid) != node.node_id:  # lost (or rejected) while the prompt computed
                    lost = _drain(queue)  # the stream moves off it as it would mid-decode: counted alike
                    if lost is not None:
                        failures, moves = self._count_move(rid, NodeLost(lost.node_id, lost.planned), len(relayed),
                                                           failures, moves)
                    continue
                node.pushed.discard(rid)
                await self.pool.send(node, KVReady(rid, list(relayed), handover))
            else:
                node = await self._send_decode(request, params, relayed, handover, timer, decision, tried,
                                               first_dispatch=failures == moves == 0)
            self.index.add(node.node_id, decision.keys)  # concurrent requests sharing the prefix follow it here
            try:
                async for out in self._relay(queue, rid):
                    relayed += out.new_token_ids
                    yield out
                # The node now also holds the generated tokens' blocks: a follow-up turn that
                # resends this conversation finds its whole history there (all but the last
                # token's, which no step computed: a block it ends is not cached).
                self.index.add(node.node_id, self.block_keys(request.prompt + relayed[:-1], scope))
                return
            except NodeLost as exc:
                await self.pool.send(node, Abort(rid))  # a hung node that comes back drops it
                if isinstance(handover, NixlHandover):  # blocks it never read: freed now, not at the lease's end
                    for prefill in [n for n in self.nodes if n.role == "prefill" and n.healthy]:
                        await self.pool.send(prefill, Abort(rid))
                # The new node recomputes prompt + relayed tokens (or finds them in its caches).
                handover = None
                failures, moves = self._count_move(rid, exc, len(relayed), failures, moves)
        raise BackendError(f"request {rid} failed on {MAX_ATTEMPTS} decode nodes")

    async def _send_decode(self, request: PlacementRequest, params: SamplingParams, relayed: list[int],
                           handover: KVHandover | None, timer: RequestTimer, decision: PlacementDecision,
                           tried: set[str], first_dispatch: bool) -> Node:
        """Send the request (pull mode) to the decode node placement chose, else another one."""
        rid, scope = request.request_id, request.scope
        node = (self.dispatch.picker.preferred(decision.plan.decode, tried)
                or await self.dispatch.picker.await_node("decode", tried))
        if node is None:
            raise BackendError("no healthy decode node")
        tried.add(node.node_id)
        if request.pin is not None:  # the node that now holds the prompt's blocks (a resume moves it)
            request.pin.node_id = node.node_id
        if first_dispatch and not relayed:
            timer.dispatched()
        self.inflight.assign(rid, node)
        await self.adapters.send_ahead(node, scope.adapter)
        await self.pool.send(node, DecodeRequest(rid, request.prompt, params, list(relayed), handover,
                                                 itl_slo_s=decision.itl_target_s, cache_salt=scope.cache_salt,
                                                 adapter=scope.adapter, images=list(scope.images)))
        return node

    def _count_move(self, rid: str, exc: NodeLost, relayed: int, failures: int, moves: int) -> tuple[int, int]:
        """A stream moved off its node: a planned move (a drain) within MAX_PLANNED_MOVES, else a failure."""
        self.counters["decode_resumes"] += 1
        if exc.planned and moves < MAX_PLANNED_MOVES:
            log.info("[%s] %s drains: resuming after %d tokens elsewhere", rid, exc, relayed)
            return failures, moves + 1
        self.metrics.retries.labels("decode").inc()
        self.metrics.failovers.labels("decode").inc()
        log.warning("[%s] %s lost after %d tokens: resuming elsewhere (attempt %d of %d)", rid, exc,
                    relayed, failures + 1, MAX_ATTEMPTS)
        return failures + 1, moves

    async def _relay(self, queue: asyncio.Queue, rid: str) -> AsyncIterator[StepOutput]:
        while True:
            try:
                async with asyncio.timeout(TOKEN_TIMEOUT_S):  # cheaper than wait_for: no task per token
                    out = await queue.get()
            except TimeoutError:
                await self.abort(rid)
                raise BackendError(f"no tokens for {TOKEN_TIMEOUT_S:.0f} s") from None
            if isinstance(out, Lost):
                raise NodeLost(out.node_id, out.planned)
            if out.finish_reason == "error":
                raise BackendError(out.error or "generation failed")
            yield out
            if out.finished:
                return

    async def embed(self, request_id: str, prompts: list[list[int]], pooling: str) -> EmbedResult:
        """Pooled, normalised final hidden states of each prompt (see embeddings.EmbeddingDispatch)."""
        return await self.dispatch.embeddings.embed(request_id, prompts, pooling)

    async def abort(self, request_id: str) -> None:
        for node in list(self.nodes):  # a copy: membership may change while a send waits
            if node.healthy:
                await self.pool.send(node, Abort(request_id))
            node.requests.discard(request_id)

    async def health(self) -> dict:
        return self.dispatch.report.render({**self.dispatch.prefill.counters, **self.dispatch.encode.counters,
                                            **self.counters})


def _drain(queue: asyncio.Queue) -> Lost | None:
    """Drop what a lost node left in a stream's queue before another node serves it; its Lost marker."""
    lost = None
    while not queue.empty():
        item = queue.get_nowait()
        lost = item if isinstance(item, Lost) else lost
    return lost
