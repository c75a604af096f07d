"""What the cluster backend's failover paths share: the lost-node signal and their bounds."""
from __future__ import annotations

PREFILL_TIMEOUT_S = 300.0  # a node that answers a prefill (or an embedding) no sooner counts as dead
# A push-mode store handover that follows its first token no later than this (the put's own
# stalls are bounded by the store's timeouts) is waited for; later, the decode node computes.
HANDOVER_TIMEOUT_S = 60.0
MAX_ATTEMPTS = 3  # per phase (prefill, decode, embedding) of one request


class NodeLost(Exception):
    """The node serving this phase of the request died, or (planned) drains; the work moves elsewhere."""

    def __init__(self, node_id: str, planned: bool = False):
        super().__init__(node_id)
        self.planned = planned
