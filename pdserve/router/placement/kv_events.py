"""Keeps the router's prefix index in step with the nodes' KV events (messages.KVEvents).

Per node: the epoch and the last batch seq applied. A batch that does not follow on (a new epoch:
the node restarted; a skipped seq: a batch was lost) is not applied; the router asks for a
snapshot instead, which replaces everything the index believed that node held. Pure logic: the
caller sends the snapshot request.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.router.placement.index import PrefixIndex
from pdserve.wire.messages import KVEvents


@dataclass
class _NodeFeed:
    epoch: int = 0
    seq: int = 0
    synced: bool = False
    snapshot_requested: bool = False


class KVEventTracker:
    def __init__(self, index: PrefixIndex):
        self.index = index
        self.feeds: dict[str, _NodeFeed] = {}
        self.counters = {"kv_event_batches": 0, "kv_snapshots": 0, "kv_resyncs": 0}

    def needs_snapshot(self, node_id: str) -> bool:
        """True once per missing sync: the caller then sends a KVSnapshotRequest."""
        feed = self.feeds.setdefault(node_id, _NodeFeed())
        if feed.synced or feed.snapshot_requested:
            return False
        feed.snapshot_requested = True
        return True

    def apply(self, node_id: str, batch: KVEvents) -> bool:
        """Apply one batch; True when it revealed a gap and a snapshot must be requested."""
        feed = self.feeds.setdefault(node_id, _NodeFeed())
        if batch.snapshot:
            self.index.drop_node(node_id)
            self.index.add(node_id, batch.stored)
            self.feeds[node_id] = _NodeFeed(batch.epoch, batch.seq, synced=True)
            self.counters["kv_snapshots"] += 1
            return False
        if feed.synced and batch.epoch == feed.epoch and batch.seq == feed.seq + 1:
            self.index.remove(node_id, batch.removed)
            self.index.add(node_id, batch.stored)
            feed.seq = batch.seq
            self.counters["kv_event_batches"] += 1
            return False
        if feed.synced:  # it was in step and fell out: a lost batch or a restart
            self.counters["kv_resyncs"] += 1
            feed.synced, feed.snapshot_requested = False, False
        return self.needs_snapshot(node_id)

    def forget(self, node_id: str) -> None:
        """A dead node: its next life starts with a snapshot."""
        self.feeds.pop(node_id, None)

    def seq(self, node_id: str) -> int:
        feed = self.feeds.get(node_id)
        return feed.seq if feed else 0
