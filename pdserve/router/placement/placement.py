"""Where a request runs, decided in one place: Placement.place, which the dispatch calls once per
request. It computes the prompt's block keys, keeps a session on its decode node, and asks the
planner (policy.Planner: node choice, then the P/D rule of pd_decision under the slo placement,
priced with costs.CostModel) for the nodes. The nodes come in as views (dispatch.node_view)."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.router.placement.keys import NO_SCOPE, BlockKeys, KVScope
from pdserve.router.placement.pd_decision import Targets
from pdserve.router.placement.policy import Planner, SessionMap
from pdserve.router.placement.views import NodeView, RoutePlan


@dataclass
class DecodePin:
    """A decode node that a group of requests shares (a beam search's rounds): the first request
    runs as any other and records the decode node its prompt was handed over to; the later ones
    run whole there, on the prompt's blocks that node now holds, so the prompt is handed over once
    and the beams fork on the decode node. Should that node go, the next request is placed as any
    other and pins the node it lands on."""
    node_id: str | None = None


@dataclass(frozen=True)
class PlacementRequest:
    request_id: str
    prompt: list[int]                # token ids
    max_tokens: int = 0
    session: str | None = None       # the OpenAI `user`, for session affinity
    targets: Targets | None = None   # this request's TTFT/ITL targets (None: the router's)
    scope: KVScope = NO_SCOPE
    pin: DecodePin | None = None     # run whole on pin.node_id while it takes requests


@dataclass(frozen=True)
class PlacementDecision:
    plan: RoutePlan
    keys: list[bytes]       # the prompt's block keys
    itl_target_s: float     # the ITL target its decode node holds for it (0: none)
    where: str              # "remote" (a prefill node), "local" (the decode node) or "whole" (a prefill node)


class Placement:
    def __init__(self, planner: Planner, block_keys: BlockKeys, sessions: SessionMap | None = None):
        self.planner = planner
        self.block_keys = block_keys
        self.sessions = sessions  # None: no session affinity

    @property
    def targets(self) -> Targets | None:
        """The router's default TTFT/ITL targets (a request may bring its own)."""
        return self.planner.targets

    def place(self, request: PlacementRequest, decode: list[NodeView], prefill: list[NodeView]) -> PlacementDecision:
        """decode: the decode nodes taking requests (non-empty); prefill: the prefill nodes (may
        be empty). The prefill node chosen is recorded in the index at once, so concurrent
        requests sharing the prefix follow it there."""
        keys = self.block_keys(request.prompt, request.scope)
        if (pinned_plan := self._pinned(request, keys, decode)) is not None:
            return PlacementDecision(pinned_plan, keys, self._itl_target(request), _where(pinned_plan, prefill))
        session = request.session if self.sessions is not None else None
        pinned = self.sessions.get(session) if session else None
        plan = self.planner.plan(request.request_id, len(request.prompt), keys, decode, prefill, request.max_tokens,
                                 pinned_decode=pinned, targets=request.targets)
        if session:
            self.sessions.put(session, plan.decode)
        if plan.prefill is not None:
            self.planner.index.add(plan.prefill, keys)
        return PlacementDecision(plan, keys, self._itl_target(request), _where(plan, prefill))

    def _itl_target(self, request: PlacementRequest) -> float:
        """The ITL target the decode node holds: the request's or the operator's, never a default
        (a request that sets none is not throttled)."""
        targets = request.targets or self.planner.targets
        if self.planner.placement != "slo" or targets is None or targets.itl_s is None:
            return 0.0
        return targets.itl_s

    def _pinned(self, request: PlacementRequest, keys: list[bytes], decode: list[NodeView]) -> RoutePlan | None:
        """The request's pinned decode node, prefilling the prompt itself; None when it has no pin
        or the node no longer takes requests."""
        node_id = request.pin.node_id if request.pin is not None else None
        node = next((n for n in decode if n.node_id == node_id), None)
        if node is None:
            return None
        held = {node_id: self.planner.index.held_prefix_blocks(node_id, keys)}
        return RoutePlan(node_id, None, self.planner.costs.held_tokens(node, held, len(request.prompt)),
                         {"pinned": True})


def _where(plan: RoutePlan, prefill: list[NodeView]) -> str:
    if plan.prefill is not None:
        return "remote"
    return "whole" if any(n.node_id == plan.decode for n in prefill) else "local"
