"""Physical KV blocks: reference counts, a prefix cache keyed by block key, and an LRU free queue.

A freed block keeps its key and contents until it is handed out again, so a later request with
the same prefix can take it back; eviction is lazy and least-recently-freed first.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    key: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        # Ordered oldest-freed first: the next block to hand out (and evict) is at the front.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.num_used = 0  # blocks with a reference: held by live requests, not idle cached ones
        # KV events: (True, key) when a key enters the prefix cache, (False, key) when it leaves.
        # None (the offline engine) records nothing; a serving node sets a list and drains it.
        self.event_sink: list[tuple[bool, bytes]] | None = None
        # Never-used blocks leave the queue in index order (they start at its front), so the
        # highest block handed out is a frontier: fresh_hook(block_id) is called as it passes it
        # (pdserve.assembly.pool_pages.WriteAhead writes the pool's pages just ahead of it).
        self.fresh_hook: Callable[[int], None] | None = None
        self.fresh_from = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise MemoryError(f"need {n} KV blocks, {len(self.free_queue)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            if block_id >= self.fresh_from:
                self.fresh_from = block_id + 1
                if self.fresh_hook is not None:
                    self.fresh_hook(block_id)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            self.num_used += 1
            ids.append(block_id)
        return ids

    def lookup(self, key: bytes) -> int | None:
        return self.cached.get(key) if self.enable_caching else None

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
                self.num_used += 1
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each; pass blocks tail-first so a prefix's tail is evicted first."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None
                self.num_used -= 1

    def cache_block(self, block_id: int, key: bytes) -> None:
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.key is not None or key in self.cached:
            return  # already cached, or an identical block holds the key
        block.key = key
        self.cached[key] = block_id
        if self.event_sink is not None:
            self.event_sink.append((True, key))

    def _evict(self, block: Block) -> None:
        if block.key is not None:
            if self.cached.get(block.key) == block.block_id:
                del self.cached[block.key]
                if self.event_sink is not None:
                    self.event_sink.append((False, block.key))
            block.key = None

    def num_in_use(self) -> int:
        return sum(1 for b in self.blocks if b.ref_cnt > 0)
