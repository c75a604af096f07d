"""Where one request's prompt is prefilled: on a prefill node (disaggregated) or on the decode node
that will decode it (local), chosen from load and the request's TTFT and ITL targets. Pure: the
load comes in as a small snapshot, so the logic is testable without sockets.

Both sides are priced with the router's TTFT cost model (policy.Planner: the tokens a node has
queued plus the ones it would compute, times its measured seconds per token), extended here to
the decode node's steps. A decode node that holds its streams' ITL target prefills in chunks: each
step takes the prompt tokens the target leaves after its decode rows (engine.tpot_budget), so a
prompt of W queued tokens there takes ceil(W / chunk) steps of at most the target each.

The rule, in order:
  1. no prefill node, or none worth a round trip (the prompt lacks few tokens): local;
  2. the decode node has no room beside its streams (a minimal chunk would push its steps past
     the ITL target): whole on the prefill node when it serves whole requests, has room beside
     its own streams and meets REMOTE_COMFORT of the TTFT target (a monolithic fallback: the
     request then decodes there too, so a decode-bound mix uses both cores); else remote,
     whatever the queue;
  3. the best prefill node meets REMOTE_COMFORT of the TTFT target: remote (the decode batch
     stays free of prefill work, which is what disaggregation is for);
  4. otherwise whichever side gives the earlier first token.
A split (the prefill node computes the first part, the decode node the rest) is never chosen:
the second part needs the first part's KV, so a split's TTFT is the sum of both parts', and since
both are linear in the tokens each side takes, one side alone is always at least as fast.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.engine.tpot_budget import StepCosts, has_headroom, prefill_tokens_per_step

# A prefill node whose estimated TTFT is within this share of the target takes the prompt: the
# estimate misses what arrives after it (Poisson bursts), so the queue is not filled to the brim.
REMOTE_COMFORT = 0.7


@dataclass(frozen=True)
class Targets:
    ttft_s: float
    itl_s: float


@dataclass(frozen=True)
class DecodeLoad:
    """The chosen decode node as the router sees it."""
    rows: int                  # streams decoding there by the time this prompt prefills (queued prompts too)
    costs: StepCosts           # its measured step costs (token_s: 0 falls back to the prefill nodes')
    queued_tokens: int = 0     # prompt tokens the router sent it to prefill that have no first token yet
    max_step_tokens: int = 2048


@dataclass(frozen=True)
class Placement:
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


def local_ttft_s(tokens: int, load: DecodeLoad, itl_s: float) -> float:
    """Seconds until the decode node has prefilled its queue and then this prompt's `tokens`."""
    work = load.queued_tokens + tokens
    chunk = prefill_tokens_per_step(load.rows, load.costs, itl_s, load.max_step_tokens)
    steps = math.ceil(work / chunk)
    return steps * load.costs.step_s(load.rows, min(chunk, work))


def place(remote_ttft_s: float | None, local_tokens: int, load: DecodeLoad, targets: Targets,
          whole: tuple[int, DecodeLoad] | None = None) -> Placement:
    """remote_ttft_s: the best prefill node's estimate (None: no prefill node). whole: that node's
    (prompt tokens it would compute, its load as a decode node) when it serves whole requests."""
    local = local_ttft_s(local_tokens, load, targets.itl_s)
    if remote_ttft_s is None:
        return Placement(True, math.inf, local, "no prefill node")
    if not has_headroom(load.rows, load.costs, targets.itl_s):
        if whole is not None and _takes_whole(*whole, targets):
            return Placement(False, remote_ttft_s, local, "decode steps at their ITL target: whole on the prefill node",
                             whole=True)
        return Placement(False, remote_ttft_s, local, "decode steps at their ITL target")
    if remote_ttft_s <= targets.ttft_s * REMOTE_COMFORT:
        return Placement(False, remote_ttft_s, local, "prefill node within the TTFT target")
    if local < remote_ttft_s:
        return Placement(True, remote_ttft_s, local, "decode node first")
    return Placement(False, remote_ttft_s, local, "prefill node first")


def _takes_whole(tokens: int, load: DecodeLoad, targets: Targets) -> bool:
    """The prefill node has room for one more stream and computes the prompt in time."""
    return (has_headroom(load.rows, load.costs, targets.itl_s)
            and local_ttft_s(tokens, load, targets.itl_s) <= targets.ttft_s * REMOTE_COMFORT)
