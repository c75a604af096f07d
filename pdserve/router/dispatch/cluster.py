"""The per-request flow over the cluster: prefill -> handover -> decode, relayed as one token
stream, with failover.

A request survives any single node failure:
  * prefill node dies or errors: the prefill is retried on another prefill node, or, with none
    left, the decode node prefills the prompt itself;
  * decode node dies mid-stream: the request resumes on another decode node, which is sent the
    prompt plus every token already relayed as its prefix and continues from the next position
    (seeded draws depend on seed and output position, so the output is the same);
each within a bounded retry budget, after which the client gets a clean error.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator

from pdserve.protocol.block_keys import block_key_chain, request_salt
from pdserve.protocol.outputs import StepOutput
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.router.dispatch.adapters import RouterAdapters
from pdserve.router.dispatch.backend import BackendError
from pdserve.router.dispatch.drain import DrainTracker
from pdserve.router.dispatch.embeddings import embed_on_nodes
from pdserve.router.dispatch.failover import MAX_ATTEMPTS, NodeLost
from pdserve.router.dispatch.health_report import cluster_health
from pdserve.router.dispatch.metrics import RequestTimer, RouterMetrics
from pdserve.router.dispatch.node_view import node_view
from pdserve.router.dispatch.nodes import Node, NodePool
from pdserve.router.dispatch.prefill import PrefillDispatch
from pdserve.router.placement.index import STORE_HOLDER, PrefixIndex
from pdserve.router.placement.kv_events import KVEventTracker
from pdserve.router.placement.pd_decision import Targets
from pdserve.router.placement.policy import Planner, RoutePlan, SessionMap
from pdserve.router.routes.tenants import NO_SCOPE, KVScope
from pdserve.router.scaling.registry_watcher import RegistryWatcher
from pdserve.router.scaling.scaler import OwnerClient, Scaler
from pdserve.wire.handover import KVHandover, StoreHandover, handover_path
from pdserve.wire.messages import (
    Abort,
    DecodeRequest,
    EmbedResult,
    KVEvents,
    KVSnapshotRequest,
    LoRAReply,
    Message,
    Pong,
    PrefillResult,
    Rejected,
    TokenDelta,
)

log = logging.getLogger(__name__)
TOKEN_TIMEOUT_S = 300.0  # a healthy node that sends nothing for this long still fails the request
MAX_PLANNED_MOVES = 16  # a stream moved off this many draining nodes counts further moves as failures
# How long a request waits for a node of a role when every one is out of rotation but some are
# only silent (still connected: a loaded host missing pings), not dead. A loaded 2-core host
# (a node process starting beside the survivors of a failover) kept every node silent for over
# 10 s: a connected node is worth waiting for well past that.
NODE_WAIT_S = 30.0


class _Lost:
    """Queue marker: the decode node serving the request was lost (or drains: planned)."""

    def __init__(self, node_id: str, planned: bool = False):
        self.node_id = node_id
        self.planned = planned


class ClusterBackend(PrefillDispatch):
    """GenerationBackend over prefill and decode nodes (prefill_addrs may be empty: then each
    request runs whole on a decode node, the monolithic mode)."""

    def __init__(self, model_name: str, prefill_addrs: list[str], decode_addrs: list[str],
                 transfer: str = "nixl", salt: bytes | None = None, block_size: int = 16,
                 prefill_policy: str = "cache_aware", decode_policy: str = "cache_aware",
                 local_prefill_threshold: int = 0, session_affinity: bool = False, registry: str | None = None,
                 owner: str | None = None, placement: str = "threshold", targets: Targets | None = None,
                 adapters: RouterAdapters | None = None):
        if not decode_addrs and registry is None:
            raise ValueError("the cluster needs at least one decode node, or a registry to find them in")
        self.registry = registry  # tcp://host:port of the node registry, or None for static lists
        self.watcher: RegistryWatcher | None = None
        self._watch_task: asyncio.Task | None = None
        self.model_name = model_name
        self.transfer = transfer
        self.salt = salt  # used only until a node reports its own (the node's salt is the contract)
        self.block_size = block_size
        self._salt_conflict_logged = False
        self._background: set[asyncio.Task] = set()
        self.pool = NodePool(prefill_addrs, decode_addrs, self._on_message, self._on_dead)
        self.nodes = self.pool.nodes
        self.adapters = adapters or RouterAdapters()  # LoRA adapters served (pdserve.router.dispatch.adapters)
        self.adapters.pool = self.pool
        self.streams: dict[str, asyncio.Queue] = {}
        self.prefill_results: dict[str, asyncio.Future] = {}
        self.owner: dict[str, str | None] = {}  # request id -> the node whose replies count
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}
        # placed_*: where the planner had prompts prefilled (local_prefills: fallbacks after failures)
        self.counters = {"prefill_retries": 0, "decode_resumes": 0, "local_prefills": 0,
                         "placed_remote": 0, "placed_local": 0, "placed_whole": 0}
        self.metrics = RouterMetrics(self.nodes)
        self.index = PrefixIndex()
        self.kv_tracker = KVEventTracker(self.index)
        self.sessions = SessionMap() if session_affinity else None
        self.planner = Planner(self.index, block_size, prefill_policy, decode_policy, local_prefill_threshold,
                               placement, targets)
        self.itl_targets: dict[str, float] = {}  # request id -> the ITL target its decode node holds
        self.drains = DrainTracker(self)
        # Admin scaling: `owner` is the zmq admin endpoint of whatever starts node processes.
        self.scaler = Scaler(self, OwnerClient(owner) if owner else None)
        self.planner_loop = None  # the SLA planner (router.planner_loop), when --planner sla

    async def start(self) -> None:
        await self.pool.start()
        if self.planner_loop is not None:
            self.planner_loop.start()
        if self.registry is not None:
            self.watcher = RegistryWatcher(self.registry, self.pool)
            self._watch_task = asyncio.create_task(self.watcher.run())

    async def stop(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)
        self.drains.cancel()
        if self.planner_loop is not None:
            await self.planner_loop.stop()
        await self.pool.stop()

    # ---- messages from nodes ----------------------------------------------------------------
    def block_keys(self, token_ids: list[int], scope: KVScope = NO_SCOPE) -> list[bytes]:
        """The prompt's block keys as the nodes compute them: with the salt the nodes report,
        mixed with the request's scope (so the index never matches another tenant's blocks)."""
        salts = sorted({n.kv_salt for n in self.nodes if n.healthy and n.kv_salt})
        if len(salts) > 1 and not self._salt_conflict_logged:
            self._salt_conflict_logged = True
            log.error("nodes report %d different KV layouts (model, dtype or block size differ): "
                      "their caches cannot be shared", len(salts))
        salt = salts[0] if salts else self.salt
        if salt is None:
            return []
        return block_key_chain(token_ids, self.block_size, request_salt(salt, scope.cache_salt, scope.adapter))

    def _send_later(self, node: Node, msg: Message) -> None:
        task = asyncio.get_running_loop().create_task(self.pool.send(node, msg))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _on_dead(self, node: Node) -> None:
        self.index.drop_node(node.node_id)  # it comes back, if at all, with an empty cache
        self.kv_tracker.forget(node.node_id)
        self.move_requests(node, list(node.requests))

    def move_requests(self, node: Node, request_ids: list[str], planned: bool = False) -> int:
        """Take these requests off `node` as if it were lost: a prefill is retried elsewhere, a
        decode stream resumes on another decode node (the failover path). planned: the node
        drains, so the move does not count against a stream's failure budget. Returns how many moved."""
        moved = 0
        for rid in request_ids:
            if self.owner.get(rid) != node.node_id:
                continue
            self.owner[rid] = None  # whatever the node still sends for it is stale
            node.requests.discard(rid)
            moved += 1
            fut = self.prefill_results.get(rid)
            if fut is not None and not fut.done():
                fut.set_exception(NodeLost(node.node_id, planned))
            queue = self.streams.get(rid)
            if queue is not None and fut is None:
                queue.put_nowait(_Lost(node.node_id, planned))
        return moved

    def _on_message(self, node: Node, msg: Message) -> None:
        if isinstance(msg, Pong):
            self.drains.on_pong(node, msg)
            for load in self.adapters.on_pong(node, msg):  # a node that joined later catches up
                self._send_later(node, load)
            if self.kv_tracker.needs_snapshot(node.node_id):
                self._send_later(node, KVSnapshotRequest())
        elif isinstance(msg, Rejected):  # the node changed role before the request reached it
            log.info("[%s] %s rejected it (%s): moving it", msg.request_id, node.node_id, msg.reason)
            self.move_requests(node, [msg.request_id])
            node.requests.discard(msg.request_id)
        elif isinstance(msg, LoRAReply):
            self.adapters.on_reply(msg)
        elif isinstance(msg, KVEvents):
            if self.kv_tracker.apply(node.node_id, msg):
                log.info("%s: KV event gap (epoch %d, seq %d): asking for a snapshot", node.node_id,
                         msg.epoch, msg.seq)
                self._send_later(node, KVSnapshotRequest())
        elif isinstance(msg, (PrefillResult, EmbedResult)):  # one reply per request, awaited
            node.requests.discard(msg.request_id)
            fut = self.prefill_results.get(msg.request_id)
            if fut is not None and not fut.done() and self.owner.get(msg.request_id) == node.node_id:
                fut.set_result(msg)
        elif isinstance(msg, TokenDelta):
            rid = msg.output.request_id
            if msg.output.finished:
                node.requests.discard(rid)
            queue = self.streams.get(rid)
            if queue is not None and self.owner.get(rid) == node.node_id:
                queue.put_nowait(msg.output)

    # ---- requests -------------------------------------------------------------------------
    def _preferred(self, node_id: str | None, tried: set[str]) -> Node | None:
        node = self.pool.get(node_id) if node_id is not None else None
        usable = node is not None and node.healthy and not node.draining
        return node if usable and node_id not in tried else None

    def _pick(self, role: str, exclude: set[str] = frozenset()) -> Node | None:
        healthy = [n for n in self.pool.by_role(role) if n.node_id not in exclude]
        if not healthy:
            return None
        return healthy[next(self._rr[role]) % len(healthy)]

    async def _await_node(self, role: str, exclude: set[str] = frozenset()) -> Node | None:
        """A healthy node of `role`, outside `exclude` where one is; None once none can come back
        within NODE_WAIT_S (every node of the role disconnected, or the wait ran out)."""
        deadline = time.monotonic() + NODE_WAIT_S
        while True:
            node = self._pick(role, exclude) or self._pick(role)
            if node is not None:
                return node
            silent = [n for n in self.pool.by_role(role, healthy_only=False) if not n.disconnected]
            if not silent or time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.05)

    def _plan(self, rid: str, prompt: list[int], params: SamplingParams, session: str | None = None,
              targets: Targets | None = None, scope: KVScope = NO_SCOPE) -> tuple[RoutePlan, list[bytes]]:
        keys = self.block_keys(prompt, scope)
        views = {role: [node_view(n, self.adapters.cost(n.node_id, scope.adapter)) for n in self.pool.by_role(role)]
                 for role in ("decode", "prefill")}
        if not views["decode"]:
            raise BackendError("no healthy decode node")
        pinned = self.sessions.get(session) if self.sessions is not None and session else None
        plan = self.planner.plan(rid, len(prompt), keys, views["decode"], views["prefill"], params.max_tokens,
                                 pinned_decode=pinned, targets=targets)
        if self.sessions is not None and session:
            self.sessions.put(session, plan.decode)
        return plan, keys

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       session: str | None = None, targets: Targets | None = None, cache_salt: str | None = None,
                       adapter: str | None = None) -> AsyncIterator[StepOutput]:
        """targets: this request's TTFT/ITL targets (the body's ttft_slo_ms/itl_slo_ms), else the router's."""
        if not self.adapters.begin(adapter):
            raise BackendError(f"LoRA adapter {adapter!r} was unloaded")
        self.streams[request_id] = asyncio.Queue()
        scope = KVScope(cache_salt, adapter)
        timer = RequestTimer(self.metrics, len(prompt_token_ids))
        relayed: list[int] = []  # every token id the client has been sent, in order
        reason = "abort"  # unless the stream reaches its end
        plan = None
        try:
            if not self.pool.by_role("decode"):
                await self._await_node("decode")
            plan, keys = self._plan(request_id, prompt_token_ids, params, session, targets, scope)
            targets = targets or self.planner.targets
            if self.planner.placement == "slo" and targets is not None:
                self.itl_targets[request_id] = targets.itl_s
            handover = None
            if self.pool.by_role("prefill"):
                self.counters[self._placed(plan)] += 1
            if plan.prefill is not None:
                self.index.add(plan.prefill, keys)
                first, handover = await self._prefill_with_retry(request_id, prompt_token_ids, params, timer,
                                                                 plan.prefill, scope)
                if isinstance(handover, StoreHandover):
                    self.index.add(STORE_HOLDER, handover.keys)  # any prefill node can load these now
                if first is not None:
                    timer.tokens(len(first.new_token_ids), first.num_cached_tokens)
                    self.metrics.handovers.labels(handover_path(handover)).inc()
                    reason = first.finish_reason if first.finished else reason
                    yield first
                    relayed += first.new_token_ids
                    if first.finished:
                        return
                    # The prompt logprobs came with the first token: the decode node owes none.
                    params = dataclasses.replace(params, prompt_logprobs=None)
            else:
                self.metrics.handovers.labels("local").inc()
                self._queue_local(plan, request_id, len(prompt_token_ids))
            async for out in self._decode_with_resume(request_id, prompt_token_ids, params, relayed, handover,
                                                      timer, plan.decode, keys, scope):
                self._unqueue_local(plan.decode, request_id)
                timer.tokens(len(out.new_token_ids), out.num_cached_tokens)
                reason = out.finish_reason if out.finished else reason
                yield out
        except BackendError:
            reason = "error"
            self.metrics.errors.labels("backend").inc()
            raise
        finally:
            timer.finished(reason)
            self.streams.pop(request_id, None)
            self.owner.pop(request_id, None)
            self.itl_targets.pop(request_id, None)
            if plan is not None:
                self._unqueue_local(plan.decode, request_id)
                self._unplace_whole(plan.decode, request_id)
            self.adapters.end(adapter)

    async def _decode_with_resume(self, rid: str, prompt: list[int], params: SamplingParams,
                                  relayed: list[int], handover: KVHandover | None, timer: RequestTimer,
                                  preferred: str | None = None, keys: list[bytes] = (),
                                  scope: KVScope = NO_SCOPE) -> AsyncIterator[StepOutput]:
        queue = self.streams[rid]
        tried: set[str] = set()
        failures = moves = 0  # planned moves off draining nodes are bounded apart from failures
        while failures < MAX_ATTEMPTS:
            node = self._preferred(preferred, tried) or await self._await_node("decode", tried)
            if node is None:
                raise BackendError("no healthy decode node")
            tried.add(node.node_id)
            if failures == moves == 0 and not relayed:
                timer.dispatched()
            self.owner[rid] = node.node_id
            node.requests.add(rid)
            await self._send_adapter_first(node, scope.adapter)
            await self.pool.send(node, DecodeRequest(rid, prompt, params, list(relayed), handover,
                                                     itl_slo_s=self.itl_targets.get(rid, 0.0),
                                                     cache_salt=scope.cache_salt, adapter=scope.adapter))
            self.index.add(node.node_id, keys)  # concurrent requests sharing the prefix follow it here
            try:
                async for out in self._relay(queue, rid):
                    relayed += out.new_token_ids
                    yield out
                # The node now also holds the generated tokens' blocks: a follow-up turn that
                # resends this conversation finds its whole history there.
                self.index.add(node.node_id, self.block_keys(prompt + relayed, scope))
                return
            except NodeLost as exc:
                await self.pool.send(node, Abort(rid))  # a hung node that comes back drops it
                # The new node recomputes prompt + relayed tokens (or finds them in its caches).
                handover = None
                self.counters["decode_resumes"] += 1
                if exc.planned and moves < MAX_PLANNED_MOVES:
                    moves += 1
                    log.info("[%s] %s drains: resuming after %d tokens elsewhere", rid, exc, len(relayed))
                    continue
                failures += 1
                self.metrics.retries.labels("decode").inc()
                self.metrics.failovers.labels("decode").inc()
                log.warning("[%s] %s lost after %d tokens: resuming elsewhere (attempt %d of %d)", rid, exc,
                            len(relayed), failures, MAX_ATTEMPTS)
        raise BackendError(f"request {rid} failed on {MAX_ATTEMPTS} decode nodes")

    async def _relay(self, queue: asyncio.Queue, rid: str) -> AsyncIterator[StepOutput]:
        while True:
            try:
                async with asyncio.timeout(TOKEN_TIMEOUT_S):  # cheaper than wait_for: no task per token
                    out = await queue.get()
            except TimeoutError:
                await self.abort(rid)
                raise BackendError(f"no tokens for {TOKEN_TIMEOUT_S:.0f} s") from None
            if isinstance(out, _Lost):
                raise NodeLost(out.node_id, out.planned)
            if out.finish_reason == "error":
                raise BackendError(out.error or "generation failed")
            yield out
            if out.finished:
                return

    async def embed(self, request_id: str, prompts: list[list[int]], pooling: str) -> EmbedResult:
        """Pooled, normalised final hidden states of each prompt (see cluster_embeddings)."""
        return await embed_on_nodes(self, request_id, prompts, pooling)

    async def abort(self, request_id: str) -> None:
        for node in list(self.nodes):  # a copy: membership may change while a send waits
            if node.healthy:
                await self.pool.send(node, Abort(request_id))
            node.requests.discard(request_id)

    async def health(self) -> dict:
        return cluster_health(self)
