"""Where one request's prompt is prefilled: on a prefill node (disaggregated) or on the decode node
that will decode it (local), chosen from load and the request's TTFT and ITL targets. Pure: the
load comes in as a small snapshot, so the logic is testable without sockets.

Both sides are priced with the router's TTFT cost model (costs.CostModel: the tokens a node has
queued plus the ones it would compute, times its measured seconds per token), extended here to
the decode node's steps. A decode node holds its streams' ITL target as a mean (TPOT): it
prefills as much per step as its streams' banked and future slack allows (node.step_budget).
When the prompt's and its queue's prefill time, spread over a stream's tokens, fits beside its
steps, the work goes in full steps; otherwise in the chunks one step's share of the target leaves
after its decode rows, ceil(W / chunk) steps for W queued tokens.

The rule, in order:
  1. no prefill node, or none worth a round trip (the prompt lacks few tokens): local, unless
     the decode node cannot take one more stream and a prefill node serving whole requests
     would decode it within the target share, or faster (place_short): then whole there;
  2. the decode node has no room for the prompt: its steps with one more stream, plus the
     prefill time of this prompt and of its queued ones spread over a stream's tokens, would
     take its streams' mean inter-token time past the target share (tpot_budget.absorbs_prefill),
     or that prefill time is more than its streams' slack as the node last reported it.
     Then remote when the decode node can still decode one more stream within the target share
     (its steps with one more row, plus its queued prompts' prefill spread over a stream's
     tokens); else whole on the prefill node when it serves whole requests and a stream there
     would decode within the target share, or faster than on the decode node: its steps with one
     more stream, plus its queued prompts' prefill time spread over a stream's tokens (a
     monolithic fallback: a decode-bound mix then decodes on both cores, while a prefill node
     with a queue keeps its core for prefill). "Within the target share" takes the node's word
     too: no stream there may be past its share already (slack_s > 0);
     otherwise remote, whatever the queue;
  3. the best prefill node meets REMOTE_COMFORT of the TTFT target: remote (the decode batch
     stays free of prefill work, which is what disaggregation is for);
  4. otherwise whichever side gives the earlier first token.
A split (the prefill node computes the first part, the decode node the rest) is never chosen:
the second part needs the first part's KV, so a split's TTFT is the sum of both parts', and since
both are linear in the tokens each side takes, one side alone is always at least as fast.

PDRule applies the rule to node views (policy.Planner calls it once per request under the slo
placement); place and place_short are the rule over a load snapshot.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.protocol.tpot_budget import (
    STREAM_TOKENS_CAP,
    TARGET_SHARE,
    StepCosts,
    absorbs_prefill,
    prefill_tokens_per_step,
    spread_tpot_s,
)
from pdserve.router.placement.costs import CostModel
from pdserve.router.placement.views import NodeView

# A prefill node whose estimated TTFT is within this share of the target takes the prompt: the
# estimate misses what arrives after it (Poisson bursts), so the queue is not filled to the brim.
REMOTE_COMFORT = 0.7
# A stream's length when the request does not say (max_tokens unknown).
DEFAULT_STREAM_TOKENS = 32


@dataclass(frozen=True)
class Targets:
    """TTFT and ITL targets in seconds; None: not set (by the request, nor by the operator)."""
    ttft_s: float | None
    itl_s: float | None

    def priced(self) -> Targets:
        """Both set: an unset one takes PRICING_TARGETS' (what the slo placement prices by)."""
        return Targets(PRICING_TARGETS.ttft_s if self.ttft_s is None else self.ttft_s,
                       PRICING_TARGETS.itl_s if self.itl_s is None else self.itl_s)


# What the slo placement prices a request by when neither it nor the operator set a target: the
# P/D rule compares the two sides' first tokens and the decode node's room at this reference.
# It only chooses where a prompt is computed; no node holds it, so such a request is admitted as
# soon as the KV cache has room (a node caps its prefill chunks only for requests with an ITL target).
PRICING_TARGETS = Targets(ttft_s=1.0, itl_s=0.1)


@dataclass(frozen=True)
class DecodeLoad:
    """A node as a host of decode streams, as the router sees it: the chosen decode node, or a
    prefill node that would run the request whole."""
    rows: int                  # streams decoding there by the time this prompt prefills (queued prompts too)
    costs: StepCosts           # its measured step costs (token_s: 0 falls back to the prefill nodes')
    queued_tokens: int = 0     # prompt tokens the router sent it to prefill that have no first token yet
    max_step_tokens: int = 2048
    slack_s: float = math.inf  # the prefill time its streams can still absorb, as the node reports it


@dataclass(frozen=True)
class PDChoice:
    local: bool
    remote_ttft_s: float
    local_ttft_s: float
    reason: str
    whole: bool = False  # prefilled and decoded on the prefill node (local is then False)

    def where(self) -> str:
        return "whole" if self.whole else "local" if self.local else "remote"

    def scores(self) -> dict:
        return {"where": self.where(), "remote_ttft": round(self.remote_ttft_s, 4),
                "local_ttft": round(self.local_ttft_s, 4), "reason": self.reason}


def local_ttft_s(tokens: int, load: DecodeLoad, itl_s: float, stream_tokens: int = 0) -> float:
    """Seconds until the decode node has prefilled its queue and then this prompt's `tokens`:
    in steps as large as the node allows when its streams can absorb the work (their mean
    inter-token time holds), else in the chunks a single step's share of the target leaves."""
    work = load.queued_tokens + tokens
    if stream_tokens > 0 and absorbs_prefill(load.rows, load.costs, itl_s, work, stream_tokens):
        chunk = load.max_step_tokens
    else:
        chunk = prefill_tokens_per_step(load.rows, load.costs, itl_s, load.max_step_tokens)
    steps = math.ceil(work / chunk)
    return steps * load.costs.step_s(load.rows, min(chunk, work))


def stream_tpot_s(load: DecodeLoad, stream_tokens: int) -> float:
    """A new stream's mean inter-token time on this node: its steps with one more row, plus the
    prefill time of the prompts queued there, spread over the stream's intervals (the node keeps
    prefilling at about that rate while the stream decodes)."""
    return spread_tpot_s(load.rows, load.costs, load.queued_tokens, stream_tokens or DEFAULT_STREAM_TOKENS)


def _has_room(load: DecodeLoad, tokens: int, targets: Targets, stream_tokens: int) -> bool:
    """The model's estimate, and the node's own word: its streams' measured slack must pay for
    the prefill too (a cost fit that is off, or streams already behind, show there first)."""
    work = load.queued_tokens + tokens
    return (absorbs_prefill(load.rows, load.costs, targets.itl_s, work, stream_tokens)
            and work * load.costs.token_s <= load.slack_s)


def _within_share(load: DecodeLoad, targets: Targets, stream_tokens: int) -> bool:
    """A new stream there would decode within the target share, by the cost model and by the
    node's own word: streams already past their share (no slack left) show a model that is off
    (longer contexts, a loaded host) before the model does."""
    return load.slack_s > 0 and stream_tpot_s(load, stream_tokens) <= targets.itl_s * TARGET_SHARE


def _takes_stream(load: DecodeLoad, targets: Targets, stream_tokens: int) -> bool:
    """The decode node can decode one more stream, prefilled elsewhere, within the target share:
    then remote. Sending it whole would make the prefill node prefill every other prompt beside
    a stream's budget, which costs the next requests' TTFT for no TPOT gained."""
    return load.rows == 0 or _within_share(load, targets, stream_tokens)


def _holds_stream_better(whole: DecodeLoad | None, load: DecodeLoad, targets: Targets, stream_tokens: int) -> bool:
    """The prefill node, serving whole requests, would decode a new stream within the target share,
    or faster than the (full) decode node would."""
    if whole is None:
        return False
    return (_within_share(whole, targets, stream_tokens)
            or stream_tpot_s(whole, stream_tokens) < stream_tpot_s(load, stream_tokens))


def place(remote_ttft_s: float | None, local_tokens: int, load: DecodeLoad, targets: Targets,
          whole: DecodeLoad | None = None, stream_tokens: int = 0, local_load_s: float = 0.0) -> PDChoice:
    """remote_ttft_s: the best prefill node's estimate (None: no prefill node). whole: that node's
    load as a decode node, when it serves whole requests. stream_tokens: the tokens a stream
    decodes (the request's max_tokens, capped; 0 unknown: then the decode node must have room in
    every step, tpot_budget.has_headroom). local_load_s: the decode node's load of the prefix the
    store holds (on its fetch thread: it adds to the first token, not to the steps)."""
    local = local_ttft_s(local_tokens, load, targets.itl_s, stream_tokens) + local_load_s
    if remote_ttft_s is None:
        return PDChoice(True, math.inf, local, "no prefill node")
    if not _has_room(load, local_tokens, targets, stream_tokens):
        if _takes_stream(load, targets, stream_tokens):
            return PDChoice(False, remote_ttft_s, local, "decode steps at their ITL target with its prefill")
        if _holds_stream_better(whole, load, targets, stream_tokens):
            return PDChoice(False, remote_ttft_s, local, "decode node full: whole on the prefill node", whole=True)
        return PDChoice(False, remote_ttft_s, local, "decode steps at their ITL target")
    if remote_ttft_s <= targets.ttft_s * REMOTE_COMFORT:
        return PDChoice(False, remote_ttft_s, local, "prefill node within the TTFT target")
    if local < remote_ttft_s:
        return PDChoice(True, remote_ttft_s, local, "decode node first")
    return PDChoice(False, remote_ttft_s, local, "prefill node first")


def place_short(local_tokens: int, load: DecodeLoad, targets: Targets, whole: DecodeLoad | None = None,
                whole_ttft_s: float = math.inf, stream_tokens: int = 0, local_load_s: float = 0.0) -> PDChoice:
    """Rule 1's second case: the prompt lacks few tokens on the decode node (a cached prefix, a
    short prompt), so no prefill node is worth a round trip and the decode node prefills it. But
    when the decode node cannot take one more stream and a prefill node that serves whole
    requests would hold it better, within the TTFT comfort share, the request runs there whole:
    a decode-bound mix then decodes on both cores, as two monolithic nodes' would. whole_ttft_s:
    that node's estimate for the prompt, its own prefix cache counted."""
    local = local_ttft_s(local_tokens, load, targets.itl_s, stream_tokens) + local_load_s
    if (not _takes_stream(load, targets, stream_tokens) and whole_ttft_s <= targets.ttft_s * REMOTE_COMFORT
            and _holds_stream_better(whole, load, targets, stream_tokens)):
        return PDChoice(False, whole_ttft_s, local, "decode node full: whole on the prefill node", whole=True)
    return PDChoice(True, whole_ttft_s, local, "few prompt tokens to compute")


@dataclass(frozen=True)
class LocalWork:
    """The prompt on the decode node: the tokens it would compute, and its load of the prefix the
    store holds (what its own cache lacks of it)."""
    tokens: int
    load_s: float


@dataclass(frozen=True)
class PDOutcome:
    """Where the rule puts a request: the node that decodes it (the decode node, or a prefill
    node that runs it whole) and the prefill node (None: the decoding node prefills it)."""
    decode: NodeView
    prefill: NodeView | None
    choice: PDChoice


class PDRule:
    """The rule over node views, each side priced with the router's cost model."""

    def __init__(self, costs: CostModel):
        self.costs = costs

    def decide(self, prompt_len: int, held: dict[str, int], d_node: NodeView, p_node: NodeView | None,
               prefill: list[NodeView], targets: Targets, max_tokens: int) -> PDOutcome | None:
        """p_node: the prefill node chosen for the prompt; None when the decode node lacks too
        few of its tokens for a round trip (rule 1: place_short). None back: nothing to decide
        (a short prompt and no prefill node serving whole requests), the decode node prefills."""
        stream_tokens = min(max_tokens, STREAM_TOKENS_CAP)
        d_load = self.host_load(d_node, prefill)
        own, stored = self.costs.reach(d_node, held, prompt_len, d_node.reads_store)
        local = LocalWork(prompt_len - own - stored, stored * self.costs.store_s_per_token(d_node, d_load.costs.token_s))
        if p_node is None:
            return self._short(prompt_len, local, held, d_node, d_load, prefill, targets, stream_tokens)
        p_load = self.host_load(p_node, prefill)
        remote = self.prefill_ttft(p_node, p_load, prefill, held, prompt_len, targets, stream_tokens, d_node)
        whole = p_load if p_node.takes_whole else None
        choice = place(remote, local.tokens, d_load, targets, whole, stream_tokens, local.load_s)
        return PDOutcome(p_node if choice.whole else d_node, None if choice.local or choice.whole else p_node, choice)

    def _short(self, prompt_len: int, local: LocalWork, held: dict[str, int], d_node: NodeView, d_load: DecodeLoad,
               prefill: list[NodeView], targets: Targets, stream_tokens: int) -> PDOutcome | None:
        """place_short: the decode node, or when that is full, the prefill node serving whole
        requests with the fewest streams."""
        hosts = [n for n in prefill if n.takes_whole]
        if not hosts:
            return None
        host = min(hosts, key=lambda n: (n.decode_rows, n.queued_tokens))
        h_load = self.host_load(host, prefill)
        h_ttft = self.prefill_ttft(host, h_load, prefill, held, prompt_len, targets, stream_tokens, d_node)
        choice = place_short(local.tokens, d_load, targets, h_load, h_ttft, stream_tokens, local.load_s)
        return PDOutcome(host if choice.whole else d_node, None, choice)

    def prefill_ttft(self, node: NodeView, load: DecodeLoad, prefill: list[NodeView], held: dict[str, int],
                     prompt_len: int, targets: Targets, stream_tokens: int, decode: NodeView) -> float:
        """A prefill node's TTFT estimate for the prompt; one that decodes streams (whole requests)
        prefills in capped chunks to hold their ITL target, so it is priced as a decode node too.
        decode: the decode node, whose measurement stands in while no prefill node has one."""
        ttft = self.costs.ttft_costs(prefill, held, prompt_len, [decode])[node.node_id]
        if node.decode_rows:
            tokens = prompt_len - self.costs.held_tokens(node, held, prompt_len)
            ttft = max(ttft, local_ttft_s(tokens, load, targets.itl_s, stream_tokens))
        return ttft

    def host_load(self, node: NodeView, prefill: list[NodeView]) -> DecodeLoad:
        """The node as a host of decode streams."""
        return DecodeLoad(node.decode_rows, self.costs.decode_costs(node, prefill), node.queued_tokens,
                          node.max_step_tokens, node.stream_slack_s)
