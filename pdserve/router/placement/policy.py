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
                targets: pd_decision.PDRule over the prefill node's estimate above and the
                decode node's batch, step costs and queued local prefills; when the decode
                node has no room under the ITL target, the request may run whole on the
                prefill node (RoutePlan.decode is then that node, prefill None)

Planner.plan is the rule over node views (the simulator calls it too); the router reaches it
through placement.Placement.place, once per request.
"""
from __future__ import annotations

import itertools
import logging
from collections import OrderedDict

from pdserve.router.placement.costs import CostModel
from pdserve.router.placement.index import PrefixIndex
from pdserve.router.placement.pd_decision import PRICING_TARGETS, PDRule, Targets
from pdserve.router.placement.views import NodeView, RoutePlan

log = logging.getLogger(__name__)
POLICIES = ("round_robin", "least_loaded", "cache_aware")
PLACEMENTS = ("threshold", "slo")
# cache_aware gives up locality when the holder has this many more requests in flight than the
# least loaded node: a warm cache is not worth queueing behind a hot spot.
BALANCE_ABS_THRESHOLD = 8


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
        self.costs = CostModel(block_size)
        self.pd = PDRule(self.costs)  # the P/D decision under the slo placement
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
        cached = self.costs.held_tokens(d_node, held, prompt_len)
        # What the decode node would compute itself: a prefix in the store it loads instead.
        lacking = prompt_len - sum(self.costs.reach(d_node, held, prompt_len, d_node.reads_store))
        p_node = None
        if prefill and lacking > self.local_prefill_threshold:
            p_node, p_scores = self._choose_prefill(prefill, held, prompt_len)
            scores.update(p_scores)
        if prefill and self.placement == "slo":
            targets = (targets or self.targets or PRICING_TARGETS).priced()
            outcome = self.pd.decide(prompt_len, held, d_node, p_node, prefill, targets, max_tokens)
            if outcome is not None:
                scores["placement"] = outcome.choice.scores()
                d_node, p_node = outcome.decode, outcome.prefill
                cached = self.costs.held_tokens(d_node, held, prompt_len)
        p_cached = self.costs.held_tokens(p_node, held, prompt_len) if p_node else 0
        plan = RoutePlan(d_node.node_id, p_node.node_id if p_node else None, cached, scores,
                         prefill_cached_tokens=p_cached)
        log.debug("[%s] route: decode=%s (%s, %d cached tokens) prefill=%s (%s) scores=%s", rid, plan.decode,
                  self.decode_policy, cached, plan.prefill, self.prefill_policy, scores)
        return plan

    def _choose_prefill(self, nodes: list[NodeView], held: dict[str, int], prompt_len: int
                        ) -> tuple[NodeView, dict]:
        if self.prefill_policy == "cache_aware":
            return self._lowest_ttft(nodes, held, prompt_len)
        return self._choose("prefill", self.prefill_policy, nodes, held)

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
        cost = self.costs.ttft_costs(nodes, held, prompt_len)
        start = next(self._rr["prefill"]) % len(nodes)  # ties go round the nodes
        node = min(nodes[start:] + nodes[:start], key=lambda n: (cost[n.node_id], n.in_flight))
        return node, {f"prefill:{n.node_id}": {"est_ttft": round(cost[n.node_id], 6), "in_flight": n.in_flight}
                      for n in nodes}

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
