"""Which routers still talk to a node.

Every router pings every node every 0.2 s. A router silent for ROUTER_GONE_S has died (or lost
its link): its clients' connections went with it, so the node ends the requests it sent at once
and frees their blocks, instead of decoding tokens nobody will read up to max_tokens.
"""
from __future__ import annotations

import os
import time

# Far above a router's stall on a loaded host (its own loop can lag for seconds): aborting a live
# router's streams would cost its clients their requests. Tests shorten it through the variable.
ROUTER_GONE_S = float(os.environ.get("PDSERVE_ROUTER_GONE_S", "10"))
CHECK_EVERY_S = 1.0


class RouterLiveness:
    def __init__(self, gone_after_s: float = ROUTER_GONE_S):
        self.gone_after_s = gone_after_s
        self.last_ping: dict[bytes, float] = {}  # router identity -> monotonic time of its last ping
        self._next_check = 0.0

    def pinged(self, identity: bytes) -> None:
        self.last_ping[identity] = time.monotonic()

    def gone(self) -> list[bytes]:
        """Routers silent for gone_after_s, each reported once (checked at most once a second)."""
        now = time.monotonic()
        if now < self._next_check:
            return []
        self._next_check = now + CHECK_EVERY_S
        silent = [i for i, seen in self.last_ping.items() if now - seen > self.gone_after_s]
        for identity in silent:
            del self.last_ping[identity]
        return silent
