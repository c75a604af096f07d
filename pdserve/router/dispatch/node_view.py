"""A node as placement sees it (placement.views.NodeView), from the router's own counts and the
node's last pong; and the counts the router keeps there for the prompts a node prefills itself."""
from __future__ import annotations

import math

from pdserve.protocol.tpot_budget import StepCosts
from pdserve.router.dispatch.nodes import Node
from pdserve.router.placement.views import NodeView


def node_view(node: Node, adapter_cost: int = 0) -> NodeView:
    """What the planner sees of a node: the router's own counts and the node's last report. On a
    decode node, queued_tokens are the prompt tokens it prefills itself that have no first token
    yet; its decode rows are every request the router has there, those queued prompts included:
    they decode beside any prompt queued after them by the time its prefill runs, but not the
    push-mode requests waiting there for a prompt that computes elsewhere. On a prefill
    node, the decode rows are the whole requests the router placed there."""
    stats = node.stats
    store_tokens = stats.get("cached_tokens_store", 0)
    requests = len(node.requests - node.pushed) if node.pushed else len(node.requests)
    costs = StepCosts(stats.get("step_base_us", 0) / 1e6, stats.get("decode_row_us", 0) / 1e6,
                      stats.get("mixed_prefill_ns_per_token", 0) / 1e9)
    return NodeView(node.node_id, requests, stats.get("free_blocks", 0), stats.get("total_blocks", 0),
                    sum(node.queued_tokens.values()), stats.get("prefill_ns_per_token", 0) / 1e9,
                    stats.get("store_load_us", 0) / 1e6 / store_tokens if store_tokens else 0.0,
                    decode_rows=len(node.whole) if node.role == "prefill" else requests, step_costs=costs,
                    max_step_tokens=stats.get("max_num_batched_tokens", 2048), adapter_cost=adapter_cost,
                    takes_whole=bool(stats.get("serves_whole", 0)),
                    stream_slack_s=stats["stream_slack_us"] / 1e6 if "stream_slack_us" in stats else math.inf,
                    reads_store=bool(stats.get("reads_store", 0)))


def queue_local(node: Node, rid: str, tokens: int) -> None:
    """The decode node prefills this prompt: its `tokens` count as queued there until the first
    token (the decision's estimate of that node's prefill queue). On a prefill node (a whole
    request) it also counts as a stream decoding there until it ends."""
    node.queued_tokens[rid] = max(tokens, 1)
    if node.role == "prefill":
        node.whole.add(rid)


def unqueue_local(node: Node, rid: str) -> None:
    node.queued_tokens.pop(rid, None)


def end_whole(node: Node, rid: str) -> None:
    node.whole.discard(rid)
