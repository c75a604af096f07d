"""Routing policies: which prefill node and which decode node serve a request, and whether the
decode node prefills the prompt itself (conditional disaggregation). Pure: candidates come in as
NodeView, the index as a PrefixIndex; no sockets, so the logic is testable alone.

  round_robin   rotate over healthy nodes
  least_loaded  fewest requests in flight, then most free KV blocks
  (least_loaded and cache_aware first keep the nodes that serve the request's LoRA adapter
  cheapest, resident before registered before absent, unless those are hot spots: Dynamo's
  and llm-d's adapter-aware routing. round_robin ignores adapters: it is the baseline.)
  cache_aware   decode: the longest prefix the node holds, unless it is much busier than the
                least loaded node (then least_loaded): SGLang's balance-threshold rule.
                prefill: the lowest estimated time to first token: the prompt tokens the node
                already has queued plus the ones it would compute for this prompt (all but the
                prefix it holds or finds in the store), times the node's measured seconds per
                prefill token; blocks loaded from the store cost their measured load time

Placement (whether the decode node prefills the prompt itself):
  threshold     when it lacks at most local_prefill_threshold prompt tokens
  slo           the same, and otherwise per request from load and the request's TTFT/ITL
                targets: pd_decision.place over the prefill node's estimate above and the
                decode node's batch, step costs and queued local prefills; when the decode
                node has no room under the ITL target, the request may run whole on the
                prefill node (RoutePlan.decode is then that node, prefill None)
"""
from __future__ import annotations

import itertools
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.protocol.tpot_budget import STREAM_TOKENS_CAP, StepCosts
from pdserve.router.placement.index import STORE_HOLDER, PrefixIndex
from pdserve.router.placement.pd_decision import DecodeLoad, Placement, Targets, local_ttft_s, place, place_short

log = logging.getLogger(__name__)
POLICIES = ("round_robin", "least_loaded", "cache_aware")
PLACEMENTS = ("threshold", "slo")
# cache_aware gives up locality when the holder has this many more requests in flight than the
# least loaded node: a warm cache is not worth queueing behind a hot spot.
BALANCE_ABS_THRESHOLD = 8
# Before a node has measured its store loads, a stored block costs this share of computing it
# (bench_kvstore: a 16-token block of the bench model loads in ~0.3 ms, computes in ~3 ms).
STORE_HIT_RELATIVE_COST = 0.1


@dataclass
class NodeView:
    node_id: str
    in_flight: int = 0      # requests the router has on it now
    free_blocks: int = 0
    total_blocks: int = 0
    queued_tokens: int = 0  # prompt tokens the router has sent it to compute and not heard back
    prefill_s_per_token: float = 0.0  # measured by the node; 0: not yet
    store_s_per_token: float = 0.0    # measured by the node (store loads); 0: not yet
    # Decode nodes: streams decoding there, its measured step costs and step token budget.
    decode_rows: int = 0
    step_costs: StepCosts = StepCosts()
    max_step_tokens: int = 2048
    # The request's LoRA adapter on this node: 0 resident (or none asked), 1 a slot load, 2 a
    # load from disk first (pdserve.router.dispatch.adapters).
    adapter_cost: int = 0
    takes_whole: bool = False  # a prefill node that also serves whole requests (slo placement)
    stream_slack_s: float = math.inf  # the prefill time its streams can still absorb (node.step_budget)


@dataclass
class RoutePlan:
    decode: str
    prefill: str | None            # None: the decode node prefills the prompt itself
    decode_cached_tokens: int = 0  # prompt tokens the decode node is believed to hold
    scores: dict = field(default_factory=dict)


class SessionMap:
    """Session (the OpenAI `user`) -> the decode node that served its last request; bounded LRU."""

    def __init__(self, max_sessions: int = 100_000):
        self.max_sessions = max_sessions
        self.nodes: OrderedDict[str, str] = OrderedDict()

    def get(self, session: str) -> str | None:
        return self.nodes.get(session)

    def put(self, session: str, node_id: str) -> None:
        self.nodes[session] = node_id
        self.nodes.move_to_end(session)
        while len(self.nodes) > self.max_sessions:
            self.nodes.popitem(last=False)


class Planner:
    def __init__(self, index: PrefixIndex, block_size: int, prefill_policy: str = "cache_aware",
                 decode_policy: str = "cache_aware", local_prefill_threshold: int = 0,
                 placement: str = "threshold", targets: Targets | None = None):
        for policy in (prefill_policy, decode_policy):
            if policy not in POLICIES:
                raise ValueError(f"unknown routing policy {policy!r}; choose from {', '.join(POLICIES)}")
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {placement!r}; choose from {', '.join(PLACEMENTS)}")
        self.placement = placement
        self.targets = targets  # the default TTFT/ITL targets (a request may bring its own)
        self.index = index
        self.block_size = block_size
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.local_prefill_threshold = local_prefill_threshold
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}

    def plan(self, rid: str, prompt_len: int, keys: list[bytes], decode: list[NodeView],
             prefill: list[NodeView], max_tokens: int = 0, pinned_decode: str | None = None,
             targets: Targets | None = None) -> RoutePlan:
        """decode must be non-empty; prefill may be empty (the decode node prefills).
        pinned_decode (session affinity) wins while that node is healthy, fits and is not a hot spot.
        targets: this request's TTFT/ITL targets (default: the planner's)."""
        held = self.index.prefix_match(keys)
        decode = self._able_to_fit(self._adapter_holders(self.decode_policy, decode), held, prompt_len + max_tokens)
        prefill = self._adapter_holders(self.prefill_policy, prefill)
        d_node, scores = self._choose("decode", self.decode_policy, decode, held)
        pinned = next((n for n in decode if n.node_id == pinned_decode), None)
        if pinned is not None and pinned.in_flight - d_node.in_flight < BALANCE_ABS_THRESHOLD:
            d_node = pinned
            scores["pinned"] = pinned.node_id
        cached = self._held_tokens(d_node, held, prompt_len)
        p_node = None
        targets = targets or self.targets
        if prefill and prompt_len - cached > self.local_prefill_threshold:
            if self.prefill_policy == "cache_aware":
                p_node, p_scores = self._lowest_ttft(prefill, held, prompt_len)
            else:
                p_node, p_scores = self._choose("prefill", self.prefill_policy, prefill, held)
            scores.update(p_scores)
            if self.placement == "slo" and targets is not None:
                placement = self._place(prompt_len, cached, held, d_node, p_node, prefill, targets, max_tokens)
                scores["placement"] = placement.scores()
                if placement.whole:  # monolithic on the prefill node
                    d_node, cached = p_node, self._held_tokens(p_node, held, prompt_len)
                if placement.local or placement.whole:
                    p_node = None
        elif prefill and self.placement == "slo" and targets is not None:  # few tokens to compute
            d_node = self._place_short(prompt_len, cached, held, d_node, prefill, targets, max_tokens, scores)
            cached = self._held_tokens(d_node, held, prompt_len)
        plan = RoutePlan(d_node.node_id, p_node.node_id if p_node else None, cached, scores)
        log.debug("[%s] route: decode=%s (%s, %d cached tokens) prefill=%s (%s) scores=%s", rid, plan.decode,
                  self.decode_policy, cached, plan.prefill, self.prefill_policy, scores)
        return plan

    def _place(self, prompt_len: int, cached: int, held: dict[str, int], d_node: NodeView, p_node: NodeView,
               prefill: list[NodeView], targets: Targets, max_tokens: int) -> Placement:
        """pd_decision.place for this request. A prefill node that decodes whole requests caps
        its prefill chunks to hold their ITL target too, so it is priced as the decode node is."""
        p_load = self._host_load(p_node, prefill)
        stream_tokens = min(max_tokens, STREAM_TOKENS_CAP)
        remote = self._prefill_ttft(p_node, p_load, prefill, held, prompt_len, targets, stream_tokens)
        whole = p_load if p_node.takes_whole else None
        return place(remote, prompt_len - cached, self._host_load(d_node, prefill), targets, whole, stream_tokens)

    def _prefill_ttft(self, node: NodeView, load: DecodeLoad, prefill: list[NodeView], held: dict[str, int],
                      prompt_len: int, targets: Targets, stream_tokens: int) -> float:
        """A prefill node's TTFT estimate for the prompt; one that decodes streams (whole requests)
        prefills in capped chunks to hold their ITL target, so it is priced as a decode node too."""
        ttft = self._ttft_costs(prefill, held, prompt_len)[node.node_id]
        if node.decode_rows:
            tokens = prompt_len - self._held_tokens(node, held, prompt_len)
            ttft = max(ttft, local_ttft_s(tokens, load, targets.itl_s, stream_tokens))
        return ttft

    def _place_short(self, prompt_len: int, cached: int, held: dict[str, int], d_node: NodeView,
                     prefill: list[NodeView], targets: Targets, max_tokens: int, scores: dict) -> NodeView:
        """pd_decision.place_short for a prompt the decode node lacks few tokens of: the node that
        decodes it, the decode node or, when that is full, the prefill node serving whole
        requests with the fewest streams."""
        hosts = [n for n in prefill if n.takes_whole]
        if not hosts:
            return d_node
        host = min(hosts, key=lambda n: (n.decode_rows, n.queued_tokens))
        stream_tokens = min(max_tokens, STREAM_TOKENS_CAP)
        h_load = self._host_load(host, prefill)
        h_ttft = self._prefill_ttft(host, h_load, prefill, held, prompt_len, targets, stream_tokens)
        placement = place_short(prompt_len - cached, self._host_load(d_node, prefill), targets, h_load, h_ttft,
                                stream_tokens)
        scores["placement"] = placement.scores()
        return host if placement.whole else d_node

    def _held_tokens(self, node: NodeView, held: dict[str, int], prompt_len: int) -> int:
        """Prompt tokens the node holds (the last one is always computed, for its logits)."""
        return min(held.get(node.node_id, 0) * self.block_size, prompt_len - 1)

    def _host_load(self, node: NodeView, prefill: list[NodeView]) -> DecodeLoad:
        return DecodeLoad(node.decode_rows, self._decode_costs(node, prefill), node.queued_tokens, node.max_step_tokens,
                          node.stream_slack_s)

    def _choose(self, role: str, policy: str, nodes: list[NodeView], held: dict[str, int]
                ) -> tuple[NodeView, dict]:
        scores = {f"{role}:{n.node_id}": {"held_blocks": held.get(n.node_id, 0), "in_flight": n.in_flight}
                  for n in nodes}
        if policy == "round_robin":
            return nodes[next(self._rr[role]) % len(nodes)], scores
        node = self._least_loaded(nodes, next(self._rr[role]))
        if policy == "cache_aware":
            best = max(nodes, key=lambda n: (held.get(n.node_id, 0), -n.in_flight, n.free_blocks))
            if held.get(best.node_id, 0) > 0 and best.in_flight - node.in_flight < BALANCE_ABS_THRESHOLD:
                node = best
        return node, scores

    def _lowest_ttft(self, nodes: list[NodeView], held: dict[str, int], prompt_len: int
                     ) -> tuple[NodeView, dict]:
        """Estimated seconds until each node has computed this prompt; the fastest wins."""
        cost = self._ttft_costs(nodes, held, prompt_len)
        start = next(self._rr["prefill"]) % len(nodes)  # ties go round the nodes
        node = min(nodes[start:] + nodes[:start], key=lambda n: (cost[n.node_id], n.in_flight))
        return node, {f"prefill:{n.node_id}": {"est_ttft": round(cost[n.node_id], 6), "in_flight": n.in_flight}
                      for n in nodes}

    @staticmethod
    def _fleet_cost(nodes: list[NodeView]) -> float:
        measured = [n.prefill_s_per_token for n in nodes if n.prefill_s_per_token > 0]
        return sum(measured) / len(measured) if measured else 1.0

    def _decode_costs(self, node: NodeView, prefill: list[NodeView]) -> StepCosts:
        """The decode node's step costs; a prompt token costs what the prefill nodes measured
        until the node has measured its own."""
        costs = node.step_costs
        if costs.token_s > 0:
            return costs
        return StepCosts(costs.base_s, costs.row_s, node.prefill_s_per_token or self._fleet_cost(prefill))

    def _ttft_costs(self, nodes: list[NodeView], held: dict[str, int], prompt_len: int) -> dict[str, float]:
        """Per node: seconds to compute its queue and then this prompt (the router's TTFT model)."""
        fleet_cost = self._fleet_cost(nodes)
        stored = held.get(STORE_HOLDER, 0) * self.block_size
        cost = {}
        for n in nodes:
            per_token = n.prefill_s_per_token or fleet_cost
            per_stored = n.store_s_per_token or per_token * STORE_HIT_RELATIVE_COST
            local = self._held_tokens(n, held, prompt_len)
            from_store = min(max(stored - local, 0), prompt_len - 1 - local)
            computed = prompt_len - local - from_store
            cost[n.node_id] = per_token * (n.queued_tokens + computed) + per_stored * from_store
        return cost

    @staticmethod
    def _adapter_holders(policy: str, nodes: list[NodeView]) -> list[NodeView]:
        """The nodes whose adapter cost is lowest, unless they are hot spots (then all)."""
        if policy == "round_robin" or not nodes:
            return nodes
        cheapest = min(n.adapter_cost for n in nodes)
        least_busy = min(n.in_flight for n in nodes)
        holders = [n for n in nodes if n.adapter_cost == cheapest
                   and n.in_flight - least_busy < BALANCE_ABS_THRESHOLD]
        return holders or nodes

    def _able_to_fit(self, nodes: list[NodeView], held: dict[str, int], tokens: int) -> list[NodeView]:
        """Never a node that cannot fit the request while another can."""
        def fits(n: NodeView) -> bool:
            need = -(-tokens // self.block_size)
            return n.total_blocks == 0 or n.free_blocks + held.get(n.node_id, 0) >= need
        return [n for n in nodes if fits(n)] or nodes

    @staticmethod
    def _least_loaded(nodes: list[NodeView], turn: int) -> NodeView:
        start = turn % len(nodes)  # ties go round the nodes, not always to the first
        return min(nodes[start:] + nodes[:start], key=lambda n: (n.in_flight, -n.free_blocks))
