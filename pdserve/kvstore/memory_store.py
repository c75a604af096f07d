"""In-process KV store: CPU copies of blocks in an LRU capped by bytes.

Used by single-process setups and tests, and as the reference behaviour for the other backends.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from pdserve.kvstore.base import KVStore
from pdserve.kvstore.layout import check_batch

DEFAULT_MAX_BYTES = 1 << 30


class MemoryKVStore(KVStore):
    """LRU over an OrderedDict (oldest first). get() refreshes recency; lookup_prefix() does not,
    because a lookup is often followed by no load at all (the router probing every node)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._bytes = 0
        # Engine loops and server threads may share one store.
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def put(self, keys: Sequence[bytes], kv_cache: torch.Tensor, block_ids: Sequence[int],
            num_tokens: Sequence[int], first_block: int = 0) -> None:
        check_batch(keys, block_ids, num_tokens)
        for key, b, n in zip(keys, block_ids, num_tokens):
            # Copy outside the lock: it is the slow part, and the source block may be reused by
            # the caller right after put() returns, so a view would not do.
            value = kv_cache[b, :, :, :n].to("cpu", copy=True).contiguous()
            with self._lock:
                self._insert(key, value)

    def _insert(self, key: bytes, value: torch.Tensor) -> None:
        nbytes = value.numel() * value.element_size()
        if nbytes > self.max_bytes:
            return  # would evict everything and still not fit
        old = self._blocks.pop(key, None)
        if old is not None:
            self._bytes -= old.numel() * old.element_size()
        self._blocks[key] = value
        self._bytes += nbytes
        while self._bytes > self.max_bytes:
            _, evicted = self._blocks.popitem(last=False)
            self._bytes -= evicted.numel() * evicted.element_size()

    def get(self, keys: Sequence[bytes], kv_cache: torch.Tensor, block_ids: Sequence[int],
            num_tokens: Sequence[int], first_block: int = 0) -> int:
        check_batch(keys, block_ids, num_tokens)
        want_tail = tuple(kv_cache.shape[1:3]) + tuple(kv_cache.shape[4:])
        loaded = 0
        for key, b, n in zip(keys, block_ids, num_tokens):
            with self._lock:
                value = self._blocks.get(key)
                if value is not None:
                    self._blocks.move_to_end(key)
            if value is None or value.dtype != kv_cache.dtype or value.shape[2] != n \
                    or tuple(value.shape[:2]) + tuple(value.shape[3:]) != want_tail:
                break
            kv_cache[b, :, :, :n].copy_(value)
            loaded += 1
        return loaded

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._blocks:
                    return i
        return len(keys)

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._bytes = 0
