"""`pdserve simulate`'s engine: a discrete-event simulation of a P/D cluster that routes with
the router's real Planner and PrefixIndex, against modelled nodes (nodes.py, costs.py).

The router sees what the real one sees: each node's requests in flight, free blocks, queued
prefill tokens and cost per token, and a prefix index fed by the nodes' cache changes (as KV
events) and by its own routing. A request's life: plan -> (prefill node queue -> prefill ->
handover of the blocks the decode node lacks) or (local prefill on the decode node) -> decode
steps in a continuous batch -> its prompt and output blocks stay in the decode node's cache ->
the session's next round after the user's think time.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.protocol.block_keys import ROOT_KEY, block_key, kv_layout_salt
from pdserve.protocol.tpot_budget import STREAM_TOKENS_CAP, StepCosts, StreamClock, amortized_prefill_tokens
from pdserve.router.placement.index import STORE_HOLDER, PrefixIndex
from pdserve.router.placement.pd_decision import Targets
from pdserve.router.placement.policy import NodeView, Planner
from pdserve.sim.costs import NodeCosts
from pdserve.sim.nodes import PrefixCache, SimDecodeNode, SimPrefillNode, SimRequest
from pdserve.sim.trace import Session

SALT = kv_layout_salt("pdserve-sim", 1, 1, 1, "float32", 16)


@dataclass
class ClusterSpec:
    prefill_nodes: int = 2
    decode_nodes: int = 2
    kv_blocks: int = 4096            # per node
    max_seqs: int = 64               # per decode node
    block_size: int = 16
    transfer: str = "nixl"           # "store": prefill nodes also write every prompt to the store
    prefix_caching: bool = True
    prefill_policy: str = "cache_aware"
    decode_policy: str = "cache_aware"
    local_prefill_threshold: int = 0
    cores: float | None = None       # nodes share this many cores (one machine); None: each has its own
    # "slo": the router's per-request placement against `targets`, and decode nodes that prefill
    # in chunks capped to hold targets.itl_s (as --prefill-placement slo); "threshold": neither.
    placement: str = "threshold"
    targets: Targets | None = None


def extend_keys(keys: list[bytes], token_ids: list[int], block_size: int) -> list[bytes]:
    """The chain of `token_ids`' full blocks, reusing `keys` (the chain of a prefix of them)."""
    out = list(keys)
    parent = out[-1] if out else ROOT_KEY
    for start in range(len(out) * block_size, len(token_ids) // block_size * block_size, block_size):
        parent = block_key(parent, token_ids[start:start + block_size], SALT)
        out.append(parent)
    return out


class Simulator:
    def __init__(self, spec: ClusterSpec, costs: NodeCosts, sessions: list[Session]):
        self.spec, self.costs, self.sessions = spec, costs, sessions
        self.index = PrefixIndex(max_keys=1 << 30)
        self.planner = Planner(self.index, spec.block_size, spec.prefill_policy, spec.decode_policy,
                               spec.local_prefill_threshold, spec.placement, spec.targets)
        self.step_costs = StepCosts(costs.decode_step_s, costs.decode_s_per_seq, costs.prefill_s_per_token)
        def cache(node_id: str) -> PrefixCache:
            return PrefixCache(node_id, self.index, enabled=spec.prefix_caching)
        self.prefill = {f"prefill-{i}": SimPrefillNode(f"prefill-{i}", cache(f"prefill-{i}"), spec.kv_blocks)
                        for i in range(spec.prefill_nodes)}
        self.decode = {f"decode-{i}": SimDecodeNode(f"decode-{i}", cache(f"decode-{i}"), spec.kv_blocks,
                                                    spec.max_seqs) for i in range(spec.decode_nodes)}
        self.store = cache(STORE_HOLDER)
        self.draining: set[str] = set()  # nodes finishing their work, routed nothing new (sim/elastic.py)
        self.by_id = {s.session_id: s for s in sessions}
        self.history_keys: dict[int, list[bytes]] = {}  # session -> its conversation's block keys
        self.done: list[SimRequest] = []
        self.now = 0.0
        self.busy_nodes = 0
        self._events: list = []
        self._seq = itertools.count()
        self._rid = itertools.count()

    # ---- the event loop -------------------------------------------------------------------
    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self) -> list[SimRequest]:
        for s in self.sessions:
            self.at(s.start_s, self.arrive, s, 0)
        while self._events:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)
        return self.done

    def _slowdown(self) -> float:
        """Busy nodes on fewer cores than nodes share them: each runs proportionally slower."""
        cores = self.spec.cores
        return max(1.0, self.busy_nodes / cores) if cores else 1.0

    # ---- routing --------------------------------------------------------------------------
    def arrive(self, session: Session, rnd: int) -> None:
        prompt = session.prompt(rnd)
        keys = extend_keys(self.history_keys.get(session.session_id, []), prompt, self.spec.block_size)
        req = SimRequest(next(self._rid), session.session_id, rnd, self.now, prompt, keys,
                         len(session.outputs[rnd]))
        self.at(self.now + self.costs.router_s, self.route, req)

    def route(self, req: SimRequest) -> None:
        prompt, keys, c = req.prompt, req.keys, self.costs
        dviews = [NodeView(d.node_id, d.routed, d.free_blocks, d.total_blocks, d.local_queued_tokens,
                           c.prefill_s_per_token, decode_rows=d.routed, step_costs=self.step_costs,
                           max_step_tokens=1 << 30) for d in self.decode.values() if d.node_id not in self.draining]
        pviews = [NodeView(p.node_id, len(p.queue) + p.busy, 0, 0, p.queued_tokens, c.prefill_s_per_token,
                           c.store_s_per_token) for p in self.prefill.values() if p.node_id not in self.draining]
        plan = self.planner.plan(str(req.rid), len(prompt), keys, dviews, pviews, req.output_tokens)
        node = self.decode[plan.decode]
        node.routed += 1
        req.decode_node, req.prefill_node = plan.decode, plan.prefill
        if plan.prefill is None:
            self.to_decode(node, req)
            return
        self.index.add(plan.prefill, keys)  # as the real router does, before any event
        p = self.prefill[plan.prefill]
        p.queue.append(req)
        p.queued_tokens += len(prompt)
        self.start_prefill(p)

    # ---- prefill nodes --------------------------------------------------------------------
    def start_prefill(self, p: SimPrefillNode) -> None:
        if p.busy or not p.queue:
            return
        req = p.queue.popleft()
        p.busy = True
        self.busy_nodes += 1
        bs, n = self.spec.block_size, len(req.prompt)
        held = min(p.cache.held_prefix(req.keys) * bs, n - 1)
        stored = min(self.store.held_prefix(req.keys) * bs, n - 1)
        from_store = max(stored - held, 0)
        req.cached_tokens = held + from_store
        seconds = (n - req.cached_tokens) * self.costs.prefill_s_per_token + from_store * self.costs.store_s_per_token
        self.at(self.now + seconds * self._slowdown(), self.finish_prefill, p, req)

    def finish_prefill(self, p: SimPrefillNode, req: SimRequest) -> None:
        p.busy = False
        self.busy_nodes -= 1
        p.queued_tokens -= len(req.prompt)
        p.cache.insert(req.keys)
        p.cache.evict_to(p.capacity_blocks)
        if self.spec.transfer == "store":
            self.store.insert(req.keys)
        req.first_token = self.now  # the prefill node samples the first token
        node = self.decode[req.decode_node]
        req.handed_blocks = len(req.keys) - node.cache.held_prefix(req.keys)  # only what it lacks
        seconds = self.costs.handover_s + req.handed_blocks * self.costs.transfer_s_per_block
        self.at(self.now + seconds, self.to_decode, node, req)
        self.start_prefill(p)

    # ---- decode nodes ---------------------------------------------------------------------
    def to_decode(self, node: SimDecodeNode, req: SimRequest) -> None:
        self.index.add(node.node_id, req.keys)
        req.remaining = req.output_tokens - (req.first_token is not None)
        node.waiting.append(req)
        if not node.stepping:
            self.step(node)

    def step(self, node: SimDecodeNode) -> None:
        bs = self.spec.block_size
        for req in node.admit(bs):
            if req.first_token is None:  # prefilled here: only what the cache lacks
                req.cached_tokens = min(node.cache.held_prefix(req.keys) * bs, len(req.prompt) - 1)
                req.local_prefill = req.prefill_left = len(req.prompt) - req.cached_tokens
        self.busy_nodes += bool(node.running) - node.stepping
        node.stepping = bool(node.running)
        if node.stepping:
            c = self.costs
            node.chunks = self._prefill_chunks(node)
            seconds = (c.decode_step_s + c.decode_s_per_seq * len(node.running)
                       + sum(node.chunks.values()) * c.prefill_s_per_token)
            self.at(self.now + seconds * self._slowdown(), self.end_step, node)

    def _prefill_chunks(self, node: SimDecodeNode) -> dict[int, int]:
        """Prompt tokens each prefilling request computes this step (request id -> tokens): all
        of them, or under "slo" what the decoding streams' TPOT clocks allow (as a real node's
        step budget does, pdserve.node.step_budget), first come first."""
        targets = self.spec.targets
        left = 1 << 30
        if self.spec.placement == "slo" and targets is not None:
            clocks = [StreamClock(targets.itl_s, r.first_token, min(r.output_tokens - 1, STREAM_TOKENS_CAP),
                                  r.output_tokens - 1 - r.remaining)
                      for r in node.running if r.first_token is not None and r.remaining > 0]
            left = amortized_prefill_tokens(clocks, self.now, node.decoding_rows, self.step_costs, left)
        chunks = {}
        for req in node.running:
            if req.prefill_left > 0 and left > 0:
                chunks[req.rid] = min(req.prefill_left, left)
                left -= chunks[req.rid]
        return chunks

    def end_step(self, node: SimDecodeNode) -> None:
        for req in list(node.running):
            if req.first_token is None:
                req.prefill_left -= node.chunks.get(req.rid, 0)
                if req.prefill_left <= 0:
                    req.first_token = self.now
                continue
            req.remaining -= 1
            if req.remaining <= 0:
                self.finish(node, req)
        self.step(node)

    def finish(self, node: SimDecodeNode, req: SimRequest) -> None:
        node.running.remove(req)
        node.in_use -= req.blocks
        node.routed -= 1
        req.finish = self.now
        self.done.append(req)
        session = self.by_id[req.session]
        history = req.prompt + session.outputs[req.round]
        keys = extend_keys(req.keys, history, self.spec.block_size)
        self.history_keys[req.session] = keys
        node.cache.insert(keys)  # the reply's blocks stay too: the next round finds its history
        node.cache.evict_to(node.total_blocks - node.in_use)
        if req.round + 1 < len(session.turns):
            self.at(self.now + session.think_s[req.round + 1], self.arrive, session, req.round + 1)
