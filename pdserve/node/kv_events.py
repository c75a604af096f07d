"""A node's KV events: the block keys its prefix cache gains and loses, batched and numbered for
the routers that ping it (see messages.KVEvents). The router keeps its prefix index from these.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

from pdserve.engine.block_pool import BlockPool
from pdserve.wire.messages import KVEvents

FLUSH_INTERVAL_S = 0.02  # batch a step's worth of events; the router's view lags by at most this
# Fault injection for tests: the batch with this seq is counted but never sent (a lost message).
DROP_BATCH_ENV = "PDSERVE_FAULT_DROP_KV_EVENT_BATCH"


class KVEventPublisher:
    def __init__(self, pool: BlockPool, node_id: str, send: Callable[[bytes, KVEvents], None]):
        self.pool, self.node_id, self.send = pool, node_id, send
        pool.event_sink = []
        self.epoch = time.time_ns()  # a restarted node starts a new epoch
        self.seq = 0
        self.routers: set[bytes] = set()  # identities of the routers that ping this node
        self._last_flush = 0.0
        self._drop_seq = int(os.environ.get(DROP_BATCH_ENV, "0") or 0)

    def flush(self, force: bool = False) -> None:
        sink = self.pool.event_sink
        if not self.routers:
            sink.clear()  # nobody listens: a router that connects later takes a snapshot
            return
        now = time.monotonic()
        if not sink or (not force and now - self._last_flush < FLUSH_INTERVAL_S):
            return
        stored, removed = _net_changes(sink)
        sink.clear()
        self._last_flush = now
        self.seq += 1
        if self.seq == self._drop_seq:
            return
        batch = KVEvents(self.node_id, self.epoch, self.seq, stored, removed)
        for identity in self.routers:
            self.send(identity, batch)

    def snapshot(self, identity: bytes) -> None:
        """Every key held now, at the current seq (pending events are flushed first, so the
        deltas that follow continue from exactly this state)."""
        self.routers.add(identity)
        self.flush(force=True)
        self.send(identity, KVEvents(self.node_id, self.epoch, self.seq, list(self.pool.cached), [],
                                     snapshot=True))


def _net_changes(sink: list[tuple[bool, bytes]]) -> tuple[list[bytes], list[bytes]]:
    """A key's last event wins (stored then evicted within a batch is just removed)."""
    last: dict[bytes, bool] = {}
    for stored, key in sink:
        last[key] = stored
    return [k for k, s in last.items() if s], [k for k, s in last.items() if not s]
