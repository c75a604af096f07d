"""Where one request's first token went on the node that made it (or, on a decode node that
pulled the prompt's KV, where its first decode step went), in seconds on that node's clock.

A node sends one with the first token it reports for a request (StepOutput.timing); the router
adds its own share and the wire's, and observes each stage in /metrics
(pdserve_request_stage_seconds), which `pdserve bench` reads back as its TTFT breakdown.
Durations only: node and router clocks are never compared."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class NodeTiming:
    queue_s: float = 0.0     # admitted (or its KV landed) -> the first step that computed it began
    load_s: float = 0.0      # admitted -> its KV from elsewhere landed (a stored prefix, a handover's pull)
    compute_s: float = 0.0   # that first step began -> its first token came out
    handover_s: float = 0.0  # a prefill node's: first token out -> the handover made (store put, NIXL pins)
