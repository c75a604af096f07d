"""The router's TTFT cost model: seconds until a node has computed a prompt, its queue first.

A node computes the prompt tokens it has queued plus the ones it lacks of this prompt (all but
the prefix it holds or finds in the store), at its measured seconds per prompt token; blocks
loaded from the store cost their measured load time. Node choice (policy: cache_aware prefill)
and the P/D rule (pd_decision.PDRule) price nodes with it."""
from __future__ import annotations

from pdserve.protocol.tpot_budget import StepCosts
from pdserve.router.placement.index import STORE_HOLDER
from pdserve.router.placement.views import NodeView

# Before a node has measured its store loads, a stored block costs this share of computing it
# (bench_kvstore: a 16-token block of the bench model loads in ~0.3 ms, computes in ~3 ms).
STORE_HIT_RELATIVE_COST = 0.1
# A prompt token's cost while no node of the cluster has measured one: small, so a prefill node
# with nothing measured is within any TTFT target and gets the prompts it must measure itself on
# (a large guess sent every prompt to the decode node, and the prefill nodes never measured);
# above zero, so queues still rank the nodes.
UNMEASURED_S_PER_TOKEN = 1e-6


class CostModel:
    def __init__(self, block_size: int):
        self.block_size = block_size

    def held_tokens(self, node: NodeView, held: dict[str, int], prompt_len: int) -> int:
        """Prompt tokens the node holds (the last one is always computed, for its logits)."""
        return min(held.get(node.node_id, 0) * self.block_size, prompt_len - 1)

    @staticmethod
    def fleet_cost(nodes: list[NodeView], peers: list[NodeView] = ()) -> float:
        """A prompt token's cost on a node that has not measured its own: the mean of the nodes'
        measurements, else of their peers' (decode nodes' prefill or mixed-step cost: the same
        model on the same kind of host), else UNMEASURED_S_PER_TOKEN."""
        for group in (nodes, peers):
            measured = [c for n in group if (c := n.prefill_s_per_token or n.step_costs.token_s) > 0]
            if measured:
                return sum(measured) / len(measured)
        return UNMEASURED_S_PER_TOKEN

    def reach(self, node: NodeView, held: dict[str, int], prompt_len: int, reads_store: bool = True
              ) -> tuple[int, int]:
        """(prompt tokens the node holds, tokens more it would load from the shared store)."""
        local = self.held_tokens(node, held, prompt_len)
        if not reads_store:
            return local, 0
        stored = held.get(STORE_HOLDER, 0) * self.block_size
        return local, min(max(stored - local, 0), prompt_len - 1 - local)

    @staticmethod
    def store_s_per_token(node: NodeView, per_token: float) -> float:
        """Loading a token's KV from the store: measured, else a share of computing it."""
        return node.store_s_per_token or per_token * STORE_HIT_RELATIVE_COST

    def ttft_costs(self, nodes: list[NodeView], held: dict[str, int], prompt_len: int,
                   peers: list[NodeView] = ()) -> dict[str, float]:
        """Per node: seconds to compute its queue and then this prompt (the router's TTFT model).
        peers: the other role's nodes, whose measurements stand in for the unmeasured."""
        fleet_cost = self.fleet_cost(nodes, peers)
        cost = {}
        for n in nodes:
            per_token = n.prefill_s_per_token or fleet_cost
            local, from_store = self.reach(n, held, prompt_len)
            computed = prompt_len - local - from_store
            cost[n.node_id] = (per_token * (n.queued_tokens + computed)
                               + self.store_s_per_token(n, per_token) * from_store)
        return cost

    def decode_costs(self, node: NodeView, prefill: list[NodeView]) -> StepCosts:
        """The decode node's step costs; a prompt token costs what the prefill nodes measured
        until the node has measured its own."""
        costs = node.step_costs
        if costs.token_s > 0:
            return costs
        return StepCosts(costs.base_s, costs.row_s, node.prefill_s_per_token or self.fleet_cost(prefill))
