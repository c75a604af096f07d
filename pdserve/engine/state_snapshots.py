"""Prefix caching for hybrid models: copies of a request's recurrent state at block boundaries,
keyed by the block key of the last block before the boundary.

A cached prefix of attention KV is useless to a hybrid model without the linear-attention and
Mamba layers' state after that prefix; that state cannot be rebuilt from the blocks. So, as a
request computes, each time a step ends exactly on a block boundary its state slot is copied
here under that block's key (the scheduler ends hybrid prefill chunks on block boundaries, so
every chunk of a long prompt leaves one). A later request whose prompt starts with those blocks
takes the KV from the prefix cache and the state from here (KVCacheManager), and computes from
the boundary on.

Snapshots are few and least recently used first out: a prefix hit needs both its blocks in the
prefix cache and the snapshot of its last block.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from pdserve.engine.state_pool import StatePool


class StateSnapshots:
    def __init__(self, pool: StatePool, num_snapshots: int, device: torch.device):
        if num_snapshots < 1:
            raise ValueError("prefix caching for a hybrid model needs at least one state snapshot")
        self.pool = pool
        self.arena = torch.zeros((num_snapshots, pool.slot_nbytes), dtype=torch.uint8, device=device)  # as the pool's
        self.by_key: OrderedDict[bytes, int] = OrderedDict()  # oldest use first
        self.free = list(range(num_snapshots))

    def __contains__(self, key: bytes) -> bool:
        return key in self.by_key

    def save(self, slot: int, key: bytes) -> None:
        """Copy a request's state slot as the state after the block whose key this is."""
        if key in self.by_key:
            self.by_key.move_to_end(key)
            return
        index = self.free.pop() if self.free else self.by_key.popitem(last=False)[1]
        self.arena[index].copy_(self.pool.arena[slot])
        self.by_key[key] = index

    def restore(self, key: bytes, slot: int) -> None:
        """Copy the snapshot saved under key into a request's state slot."""
        index = self.by_key[key]
        self.by_key.move_to_end(key)
        self.pool.arena[slot].copy_(self.arena[index])

    def get(self, key: bytes) -> torch.Tensor | None:
        """A copy of the snapshot under key (a store write reads it off the node's loop), or None."""
        index = self.by_key.get(key)
        return None if index is None else self.arena[index].clone()
