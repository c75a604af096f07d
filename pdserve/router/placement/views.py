"""What placement sees of a node (NodeView, built from the router's counts and the node's last
pong by dispatch.node_view) and what it decides for a request (RoutePlan)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.protocol.tpot_budget import StepCosts


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
    reads_store: bool = False  # a prompt it computes itself loads what the shared store holds of it


@dataclass
class RoutePlan:
    decode: str
    prefill: str | None            # None: the decode node prefills the prompt itself
    decode_cached_tokens: int = 0  # prompt tokens the decode node is believed to hold
    scores: dict = field(default_factory=dict)
    prefill_cached_tokens: int = 0  # ... and the prefill node
