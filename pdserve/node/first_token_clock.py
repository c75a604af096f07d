"""Each request's way to its first token on this node, for the TTFT breakdown
(pdserve.protocol.timing): when it was admitted, when its KV from elsewhere landed, and when
the first step that computed any of its tokens began. The node's loop feeds it; nothing here
touches the engine's state, it only reads how far a request got after each step."""
from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.engine.request import Request
from pdserve.protocol.timing import NodeTiming


@dataclass
class _Clock:
    req: Request
    admitted: float
    computed: int  # its tokens computed at admission (prefix-cache hits): a step that adds to them ran it
    landed: float = 0.0
    started: float = 0.0


class FirstTokenClocks:
    def __init__(self) -> None:
        self.clocks: dict[str, _Clock] = {}

    def admit(self, req: Request) -> None:
        self.clocks[req.request_id] = _Clock(req, time.perf_counter(), req.num_computed_tokens)

    def landed(self, rid: str) -> None:
        """Its KV from elsewhere (a stored prefix, a handover) is in its blocks."""
        clock = self.clocks.get(rid)
        if clock is not None and not clock.landed:
            clock.landed = time.perf_counter()

    def stepped(self, began: float) -> None:
        """A step that began at `began` ended: the requests it computed for the first time started then."""
        for clock in self.clocks.values():
            if not clock.started and (clock.req.num_computed_tokens > clock.computed or clock.req.status.is_finished):
                clock.started = began

    def first_token(self, rid: str) -> NodeTiming | None:
        """Its first token is out now: where its time went (None: not admitted through here)."""
        clock = self.clocks.pop(rid, None)
        if clock is None:
            return None
        now = time.perf_counter()
        started = clock.started or now
        ready = clock.landed or clock.admitted  # a request waits for its KV before it can queue for a step
        return NodeTiming(queue_s=max(started - ready, 0.0), load_s=ready - clock.admitted,
                          compute_s=now - started)

    def forget(self, rid: str) -> None:
        self.clocks.pop(rid, None)
