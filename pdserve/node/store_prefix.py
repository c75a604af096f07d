"""A prompt whose leading blocks are in the shared KV store loads them instead of computing them,
on whichever node computes it: a prefill node's handovers, a prefill node's whole requests, and a
decode node's own prefills. A conversation turn whose history has left every node's paged cache
(a long pause, a busy node's LRU) then comes back from the store wherever the router places it.

The prefill node loads on its own thread at admission (StorePrefix.load); the decode node, whose
streams must not wait for a load, fetches through its store puller as it pulls a handover
(StorePrefix.handover names the blocks).

A hybrid model's prefix is of use only with the recurrent state after it: a stored prefix counts
only as far as the last block whose state the store holds too (under the block's state key,
pdserve.protocol.block_keys.state_key), and that state loads with the blocks."""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from pdserve.kvstore.base import KVStore
from pdserve.kvstore.errors import KVStoreError
from pdserve.protocol.block_keys import block_key_chain, state_key
from pdserve.wire.handover import StoreHandover

log = logging.getLogger(__name__)
# The lookup runs while the node's loop waits, and that loop answers the router's pings: a store
# that stalls (a stopped Redis waits out its client's 2-5 s timeouts) must not hold it past a
# pong or two, or the router takes the node out of rotation. Past this the prompt is computed.
LOOKUP_TIMEOUT_S = 0.25


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
        self._looker = ThreadPoolExecutor(1, thread_name_prefix="store-lookup")
        self._lookup: Future | None = None

    def stored_tokens(self, keys: list[bytes], prompt_len: int) -> int:
        """Tokens of the leading full blocks the store holds. Only blocks before the last prompt
        token count: that token is always computed, for its logits."""
        full = keys[:(prompt_len - 1) // self.engine.config.block_size]
        if not full:
            return 0
        if self._lookup is not None and not self._lookup.done():
            return 0  # a lookup is still stuck on a stalled store: compute, do not queue behind it
        self._lookup = self._looker.submit(self._stored_blocks, full)
        try:
            return self._lookup.result(LOOKUP_TIMEOUT_S) * self.engine.config.block_size
        except FutureTimeout:
            log.warning("store lookup took over %.2f s, computing the whole prompt", LOOKUP_TIMEOUT_S)
        except KVStoreError as exc:
            log.warning("store lookup failed, computing the whole prompt: %s", exc)
        return 0

    def _stored_blocks(self, keys: list[bytes]) -> int:
        """Leading blocks the store holds, for a hybrid model up to the last with its state."""
        found = self.store.lookup_prefix(keys)
        states = self.engine.kv.states
        if states is None or not found:
            return found
        held = self.store.has_states([state_key(k, states.layout) for k in keys[:found]])
        return max((i + 1 for i, h in enumerate(held) if h), default=0)

    def state_key(self, keys: list[bytes], stored: int) -> bytes:
        """The state key of a hybrid model's stored prefix of `stored` tokens; b"": none."""
        states = self.engine.kv.states
        return b"" if states is None or not stored else state_key(keys[stored // self.engine.config.block_size - 1],
                                                                   states.layout)

    def close(self) -> None:
        self._looker.shutdown(wait=False, cancel_futures=True)

    def handover(self, keys: list[bytes], stored: int) -> StoreHandover:
        """The stored prefix as a handover the decode node's store puller fetches."""
        return StoreHandover(stored, keys[:stored // self.engine.config.block_size],
                             state_key=self.state_key(keys, stored))

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
            if loaded == len(wanted) and stored > local and req.state_slot is not None:
                loaded -= not self.store.get_state(self.state_key(keys, stored), self.engine.kv.states.arena,
                                                   req.state_slot)
        except KVStoreError as exc:
            log.warning("[%s] store fetch failed: %s", req.request_id, exc)
            loaded = -1
        self.stats.store_load_us += int((time.perf_counter() - t0) * 1e6)
        ok = loaded == len(wanted)
        self.engine.report_remote_kv(req.request_id, ok=ok, cached_tokens=stored)
        if ok:
            self.count_loaded(stored - local)
        return ok

    def count_loaded(self, tokens: int) -> None:
        self.stats.cached_tokens_store += max(tokens, 0)
