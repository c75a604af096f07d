"""Which nodes this router pairs: those whose KV is the same bytes (pdserve.wire.compat).

Nodes are grouped by what their KV is (KVCompat.kv_key). The router serves one group, the
admitted one: any of its prefill nodes may hand over to any of its decode nodes, and a decode
stream that fails over resumes on a node that computes exactly as the first did. A node of
another group is refused (kept out of the rotation, with the reason in the log and in /health),
so no handover ever crosses groups.

The admitted group is the one with a decode node and the most nodes, the group admitted so far
winning a tie, then the group heard from first: one odd node that happens to start first does
not lock out the rest. A node whose LoRA adapter of some name has other weights than the group's
adapter of that name is refused too.
"""
from __future__ import annotations

import msgspec

from pdserve.wire.compat import KVCompat, compat_mismatch

PAIRED_ROLES = ("prefill", "decode")  # encoder nodes hand over embeddings, not KV


class CompatGate:
    def __init__(self) -> None:
        self.reports: dict[str, tuple[str, KVCompat]] = {}  # node id -> (role, descriptor), first heard first
        self.reference: KVCompat | None = None  # the admitted group's, with its adapters' digests
        self._refusals: dict[str, str] = {}

    def report(self, node_id: str, role: str, compat: KVCompat) -> None:
        """A node said what its KV is (every pong): regroup when that changed."""
        if role not in PAIRED_ROLES or self.reports.get(node_id) == (role, compat):
            return
        self.reports[node_id] = (role, compat)
        self._regroup()

    def forget(self, node_id: str) -> None:
        """The node left the cluster (not merely died: a dead node comes back as it was)."""
        if self.reports.pop(node_id, None) is not None:
            self._refusals.pop(node_id, None)
            self._regroup()

    def refusal(self, node_id: str) -> str | None:
        """Why this node is refused, or None when it is admitted (or has not said)."""
        return self._refusals.get(node_id)

    def _regroup(self) -> None:
        groups: dict[tuple, list[str]] = {}
        for node_id, (_, compat) in self.reports.items():
            groups.setdefault(compat.kv_key(), []).append(node_id)
        current = self.reference.kv_key() if self.reference is not None else None

        def rank(key: tuple) -> tuple:
            members = groups[key]
            has_decode = any(self.reports[n][0] == "decode" for n in members)
            return has_decode, len(members), key == current

        chosen = max(groups, key=rank) if groups else None  # max keeps the first of equals
        self._refusals.clear()
        self.reference = None
        adapters: dict[str, str] = {}
        for node_id, (_, compat) in self.reports.items():
            if compat.kv_key() != chosen:
                continue
            if self.reference is not None and (why := compat_mismatch(self.reference, compat)) is not None:
                self._refusals[node_id] = why
                continue
            adapters = {**compat.loras, **adapters}  # the first node serving a name sets its weights
            self.reference = msgspec.structs.replace(compat, loras=dict(adapters))
        for node_id, (_, compat) in self.reports.items():
            if compat.kv_key() != chosen:
                self._refusals[node_id] = compat_mismatch(self.reference, compat) or "another KV group"
