"""The router's prefix index: block key -> the nodes believed to hold that block.

Fed two ways: by the nodes' KV events (what each node's prefix cache gained and evicted; see
router/kv_events.py), and at once by what the router itself routes (the prompt's blocks on the
chosen nodes, before any event can arrive), as SGLang's cache-aware router does. An entry can be
stale for a moment (an eviction not yet reported): the request then computes those tokens, it
never fails. The shared KV store is one more holder, STORE_HOLDER: the blocks prefill nodes put
there (no events: Redis may lose them, and then the prefill node computes them).
The index is bounded (least recently used keys go first) so the router's memory stays flat.
Pure data: no sockets, no asyncio.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

DEFAULT_MAX_KEYS = 1 << 20
STORE_HOLDER = "@store"


class PrefixIndex:
    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS):
        self.max_keys = max_keys
        self.holders: OrderedDict[bytes, set[str]] = OrderedDict()
        self.counts: dict[str, int] = {}  # node id -> keys it holds

    def add(self, node_id: str, keys: Iterable[bytes]) -> None:
        for key in keys:
            nodes = self.holders.get(key)
            if nodes is None:
                nodes = self.holders[key] = set()
            else:
                self.holders.move_to_end(key)
            if node_id not in nodes:
                nodes.add(node_id)
                self.counts[node_id] = self.counts.get(node_id, 0) + 1
        while len(self.holders) > self.max_keys:
            for gone in self.holders.popitem(last=False)[1]:
                self.counts[gone] -= 1

    def remove(self, node_id: str, keys: Iterable[bytes]) -> None:
        """The node evicted these blocks."""
        for key in keys:
            nodes = self.holders.get(key)
            if nodes is None or node_id not in nodes:
                continue
            nodes.discard(node_id)
            self.counts[node_id] -= 1
            if not nodes:
                del self.holders[key]

    def drop_node(self, node_id: str) -> None:
        """A dead or restarted node holds nothing any more."""
        self.remove(node_id, [k for k, nodes in self.holders.items() if node_id in nodes])
        self.counts.pop(node_id, None)

    def held_prefix_blocks(self, node_id: str, keys: list[bytes]) -> int:
        """How many leading blocks of `keys` the node is believed to hold."""
        n = 0
        for key in keys:
            nodes = self.holders.get(key)
            if nodes is None or node_id not in nodes:
                break
            n += 1
        return n

    def prefix_match(self, keys: list[bytes]) -> dict[str, int]:
        """Every node's held leading blocks of `keys`, in one walk: the walk follows only nodes
        still matching and stops when none is, so its cost does not grow with the node count."""
        if not keys or keys[0] not in self.holders:
            return {}
        alive = set(self.holders[keys[0]])
        held = dict.fromkeys(alive, 1)
        for i, key in enumerate(keys[1:], start=2):
            alive.intersection_update(self.holders.get(key, ()))
            if not alive:
                break
            for node in alive:
                held[node] = i
        return held

    def size(self, node_id: str) -> int:
        return self.counts.get(node_id, 0)
