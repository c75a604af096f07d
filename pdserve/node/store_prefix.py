"""A prompt whose leading blocks are in the shared KV store loads them instead of computing them,
on whichever node computes it: a prefill node's handovers, a prefill node's whole requests, and a
decode node's own prefills. A conversation turn whose history has left every node's paged cache
(a long pause, a busy node's LRU) then comes back from the store wherever the router places it.

The prefill node loads on its own thread at admission (StorePrefix.load); the decode node, whose
streams must not wait for a load, fetches through its store puller as it pulls a handover
(StorePrefix.handover names the blocks)."""
from __future__ import annotations

import logging
import time

from pdserve.kvstore.base import KVStore
from pdserve.kvstore.errors import KVStoreError
from pdserve.protocol.block_keys import block_key_chain
from pdserve.wire.handover import StoreHandover

log = logging.getLogger(__name__)


def request_block_keys(engine, prompt: list[int], cache_salt: str | None, adapter: str | None,
                       images=()) -> list[bytes]:
    """The prompt's block keys as every node computes them (the last maybe a partial block's)."""
    salt = engine.request_salt(cache_salt, adapter)  # a tenant's blocks are its own
    return block_key_chain(prompt, engine.config.block_size, salt, include_partial=True, images=images)


class StorePrefix:
    def __init__(self, engine, store: KVStore, stats):
        self.engine = engine
        self.store = store
        self.stats = stats  # the node's NodeStats: store tokens and load time, for the router's costs

    def stored_tokens(self, keys: list[bytes], prompt_len: int) -> int:
        """Tokens of the leading full blocks the store holds. Only blocks before the last prompt
        token count: that token is always computed, for its logits."""
        full = keys[:(prompt_len - 1) // self.engine.config.block_size]
        if not full:
            return 0
        try:
            return self.store.lookup_prefix(full) * self.engine.config.block_size
        except KVStoreError as exc:
            log.warning("store lookup failed, computing the whole prompt: %s", exc)
            return 0

    def handover(self, keys: list[bytes], stored: int) -> StoreHandover:
        """The stored prefix as a handover the decode node's store puller fetches."""
        return StoreHandover(stored, keys[:stored // self.engine.config.block_size])

    def load(self, req, keys: list[bytes], stored: int) -> bool:
        """Fetch the stored prefix into the request's blocks now (the request waits in
        WAITING_FOR_REMOTE_KVS) and tell the engine whether it landed; if not, it computes."""
        bs = self.engine.config.block_size
        local = req.num_computed_tokens
        # Blocks already cached locally need no fetch; slid-out ones (out of every layer's
        # window) are not held at all.
        first = max(local // bs, req.num_slid_blocks)
        wanted = keys[first:stored // bs]
        ids = req.block_ids[first:first + len(wanted)]
        t0 = time.perf_counter()
        try:
            loaded = self.store.get(wanted, self.engine.kv_cache, ids, [bs] * len(wanted), first_block=first)
        except KVStoreError as exc:
            log.warning("[%s] store fetch failed: %s", req.request_id, exc)
            loaded = -1
        self.stats.store_load_us += int((time.perf_counter() - t0) * 1e6)
        ok = loaded == len(wanted)
        self.engine.report_remote_kv(req.request_id, ok=ok)
        if ok:
            req.num_cached_tokens = max(req.num_cached_tokens, stored)
            self.count_loaded(stored - local)
        return ok

    def count_loaded(self, tokens: int) -> None:
        self.stats.cached_tokens_store += max(tokens, 0)
