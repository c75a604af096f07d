"""The tiered KV store: LMCache (local CPU -> local disk -> Redis over its native resp:// client)
holding whole chunks of blocks, with the trailing partial chunk on the direct Redis path.

How pdserve maps onto LMCache (checked against lmcache 0.5.6):

* One LMCache chunk = chunk_tokens / block_size whole blocks (chunk_plan.py). Its LMCache chunk
  hash is the 16-byte block key of its last block read as a 128-bit int, passed through
  store()/lookup()'s hashes=/offsets= path, so LMCache's token hashing never runs.
  retrieve() only takes tokens=, so a _KeyChain stands in for them and a token database
  expands it back into hashes/offsets.
* The tail (blocks after the last whole chunk, the partial block included) goes block by
  block through `tail`, the direct Redis store (resp:// refuses save_unfull_chunk and its GET
  fails on a value shorter than a chunk). Readers try chunks first, then the tail path from the
  first chunk missing, so a prefix that was a writer's tail is still found block by block.
* put() returns once the chunks are in Redis (other nodes read them there): LMCache writes the
  remote tier in the background, and we wait on RemoteBackend.put_tasks (lmcache_compat).
* LMCache stages every chunk in the CPU tier and drops what does not fit in one call, so calls
  go in slices of at most a quarter of the tier.
* Integrity: LMCache checks no payload; put() records each chunked block's digest beside it in
  Redis (digest_ledger.py) and get() keeps only the leading blocks that match. The tail path
  carries its own checksum.
* A dead Redis reads as a miss (LMCache swallows remote errors): 0, not KVStoreError.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from pdserve.kvstore.base import KVStore
from pdserve.kvstore.chunk_plan import ChunkSpan, chunks_to_get, chunks_to_put
from pdserve.kvstore.digest_ledger import DigestLedger
from pdserve.kvstore.errors import KVStoreError
from pdserve.kvstore.layout import KVLayout, check_batch
from pdserve.kvstore.lmcache_compat import (
    ChunkedTokenDatabase,
    LMCacheEngine,
    LMCacheEngineBuilder,
    LMCacheEngineConfig,
    LMCacheMetadata,
    close_in_daemon,
    disk_write_queues,
    keep_start_method,
    leading_keys_present,
    quiet_lmcache_logs,
    quiet_logger_setup,
    reconnect_resp,
    remote_backends,
    shutdown_engine,
    track_batched_puts,
)
from pdserve.kvstore.lmcache_config import chunk_bytes, cpu_tier_bytes
from pdserve.kvstore.lmcache_connector import PagedChunkConnector
from pdserve.kvstore.redis_cluster import initialize_lmcache_cluster

logger = logging.getLogger(__name__)


def chunk_hash(key: bytes) -> int:
    """LMCache chunk hash for one of our block keys (all 128 bits, so no extra collisions)."""
    return int.from_bytes(key, "big")


class _KeyChain:
    """Stands in for `tokens` in LMCacheEngine.retrieve(), which has no hashes= argument."""

    def __init__(self, hashes: list[int], offsets: list[int]) -> None:
        self.hashes, self.offsets = hashes, offsets

    def __len__(self) -> int:
        return sum(self.offsets)


class _BlockKeyTokenDatabase(ChunkedTokenDatabase):
    def process_tokens(self, tokens: Any = None, hashes: Any = None, offsets: Any = None,
                       mask: Any = None, make_key: bool = True, request_configs: dict | None = None) -> Any:
        if isinstance(tokens, _KeyChain):
            return super().process_tokens(hashes=tokens.hashes, offsets=tokens.offsets,
                                          make_key=make_key, request_configs=request_configs)
        return super().process_tokens(tokens, hashes, offsets, mask, make_key, request_configs)


def _no_broadcast(*_args: Any, **_kwargs: Any) -> Any:
    """Single worker: nothing to broadcast (only LMCache's multi-rank MLA mode uses it)."""
    return None


def build_engine(layout: KVLayout, connector: PagedChunkConnector, config: LMCacheEngineConfig,
                 instance_id: str) -> LMCacheEngine:
    chunk = int(config.chunk_size)
    metadata = LMCacheMetadata(
        model_name=layout.model_name, world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=layout.dtype,
        kv_shape=(layout.num_layers, layout.planes, chunk, layout.num_kv_heads, layout.head_dim),
        use_mla=layout.planes == 1, chunk_size=chunk)
    try:
        with keep_start_method(), quiet_logger_setup():
            engine = LMCacheEngineBuilder.get_or_create(instance_id, config, metadata, connector,
                                                        _no_broadcast, _no_broadcast)
            try:
                engine.token_database = _BlockKeyTokenDatabase(config, metadata)
                engine.post_init()  # creates the storage backends; store() asserts without it
                for backend in remote_backends(engine):
                    track_batched_puts(backend)
                    reconnect_resp(backend)
                    initialize_lmcache_cluster(backend)
            except BaseException:
                shutdown_engine(engine, instance_id, timeout=2.0)  # stop its non-daemon loop thread
                raise
    finally:
        quiet_lmcache_logs()  # again: post_init imports modules that made new loggers
    return engine


class LMCacheKVStore(KVStore):
    """KVStore over an LMCacheEngine holding whole chunks, plus `tail` for the partial rest."""

    def __init__(self, layout: KVLayout, config: LMCacheEngineConfig, *, tail: KVStore,
                 ledger_url: str | None = None, wait_remote_s: float = 10.0,
                 close_timeout_s: float = 5.0) -> None:
        """config: from lmcache_config.build_config (checked against layout). tail: the store
        for blocks outside whole chunks. ledger_url: the Redis for block digests (None: no
        remote tier, nothing to check against)."""
        quiet_lmcache_logs()
        self.layout, self.tail, self.config = layout, tail, config
        self.chunk_blocks = int(self.config.chunk_size) // layout.block_size
        self.wait_remote_s, self.close_timeout_s = wait_remote_s, close_timeout_s
        # Unique id: the builder caches engines by id, and two stores must not share one.
        self.instance_id = f"pdserve-{uuid.uuid4().hex[:12]}"
        self._connector = PagedChunkConnector(layout)
        self._engine: LMCacheEngine | None = build_engine(layout, self._connector, self.config, self.instance_id)
        # LMCache's engine expects one caller at a time (vLLM drives it from one worker thread).
        self._lock = threading.Lock()
        self.chunks_per_call = max(1, cpu_tier_bytes(config) // 4 // chunk_bytes(config, layout))
        self._digests = DigestLedger(ledger_url) if ledger_url else None

    @property
    def engine(self) -> LMCacheEngine:
        if self._engine is None:
            raise RuntimeError("LMCacheKVStore is closed")
        return self._engine

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_blocks * self.layout.block_size

    # ---- put --------------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], kv_cache: torch.Tensor, block_ids: Sequence[int],
            num_tokens: Sequence[int], first_block: int = 0) -> None:
        check_batch(keys, block_ids, num_tokens)
        span = chunks_to_put(first_block, num_tokens, self.layout.block_size, self.chunk_blocks)
        lo, hi = span.start - first_block, span.end - first_block
        if span.num_chunks:
            self._put_chunks(keys[lo:hi], kv_cache, block_ids[lo:hi])
        rest = [i for i in range(len(keys)) if not lo <= i < hi or not span.num_chunks]
        if rest:
            self.tail.put([keys[i] for i in rest], kv_cache, [block_ids[i] for i in rest],
                          [num_tokens[i] for i in rest])

    def _put_chunks(self, keys: Sequence[bytes], kv_cache: torch.Tensor, block_ids: Sequence[int]) -> None:
        """keys/block_ids: whole chunks, aligned, every block full."""
        C, bs = self.chunk_blocks, self.layout.block_size
        step = self.chunks_per_call * C
        previous: set[int] = set()
        for lo in range(0, len(keys), step):
            part_keys, part_ids = keys[lo:lo + step], list(block_ids[lo:lo + step])
            hashes = [chunk_hash(part_keys[j]) for j in range(C - 1, len(part_keys), C)]
            # A CPU tier too small for the whole put: the last part's chunks hold their memory
            # until the disk tier has them, and LMCache drops (never stores) a chunk it cannot
            # allocate. Wait for those writes, not for the last part's (the first token waits).
            self._wait_written(previous, disk_write_queues(self.engine), "disk")
            previous = set(hashes)
            # Digests first: written after the chunks, the small MSET queues behind megabytes of
            # chunk SETs in single-threaded Redis (measured: most of a put's time).
            reachable = self._digests is None or self._digests.put(part_keys, kv_cache, part_ids,
                                                                   [bs] * len(part_keys))
            with self._lock:
                self.engine.store(hashes=hashes, offsets=[C * bs] * len(hashes),
                                  kv_cache=kv_cache, slot_mapping=part_ids)
            if reachable:  # else Redis is down: the writes fail in the background, do not wait
                queues = [(b.lock, b.put_tasks) for b in remote_backends(self.engine)]
                self._wait_written(set(hashes), queues, "remote")

    def _wait_written(self, hashes: set[int], queues: list[tuple[Any, list]], tier: str) -> None:
        """Until no queue (a tier's lock and the keys it is still writing) holds these chunks."""
        if not hashes:
            return
        deadline = time.monotonic() + self.wait_remote_s
        for lock, tasks in queues:
            while True:
                with lock:
                    pending = any(k.chunk_hash in hashes for k in tasks)
                if not pending:
                    break
                if time.monotonic() > deadline:
                    logger.warning("LMCache %s writes still pending after %.1fs", tier, self.wait_remote_s)
                    return
                time.sleep(0.0005)

    # ---- get --------------------------------------------------------------------------------
    def get(self, keys: Sequence[bytes], kv_cache: torch.Tensor, block_ids: Sequence[int],
            num_tokens: Sequence[int], first_block: int = 0) -> int:
        check_batch(keys, block_ids, num_tokens)
        span = chunks_to_get(first_block, num_tokens, self.layout.block_size, self.chunk_blocks)
        loaded = self._get_chunks(span, first_block, keys, kv_cache, block_ids) if span.num_chunks else 0
        if loaded < 0:  # a chunk failed its digest: compute from there, trust nothing after
            return -loaded - 1
        if loaded == len(keys):
            return loaded
        try:
            return loaded + self.tail.get(keys[loaded:], kv_cache, block_ids[loaded:], num_tokens[loaded:],
                                          first_block=first_block + loaded)
        except KVStoreError:
            if not loaded:
                raise
            logger.warning("tail blocks unreadable; keeping the %d blocks loaded from chunks", loaded)
            return loaded

    def _get_chunks(self, span: ChunkSpan, first_block: int, keys: Sequence[bytes],
                    kv_cache: torch.Tensor, block_ids: Sequence[int]) -> int:
        """Blocks of the slice loaded from leading whole chunks and verified; -(n + 1) when a
        digest failed after n good blocks."""
        C, bs = self.chunk_blocks, self.layout.block_size
        skip = first_block - span.start  # blocks of the first chunk already cached here
        table = [-1] * skip + list(block_ids[:span.end - first_block])
        positions = span.last_block_positions()
        hashes = [chunk_hash(keys[p - first_block]) for p in positions]
        chunks = 0
        for lo in range(0, len(hashes), self.chunks_per_call):
            part = hashes[lo:lo + self.chunks_per_call]
            got = self._retrieve(part, kv_cache, table[lo * C:(lo + len(part)) * C])
            chunks += got
            if got < len(part):
                break
        loaded = max(0, chunks * C - skip)
        if self._digests is None or loaded == 0:
            return loaded
        good = self._digests.verified(keys[:loaded], kv_cache, block_ids[:loaded], [bs] * loaded)
        return loaded if good == loaded else -(good + 1)

    def _retrieve(self, hashes: list[int], kv_cache: torch.Tensor, table: list[int]) -> int:
        """How many leading chunks LMCache found and loaded into their blocks."""
        size = self.chunk_tokens
        with self._lock:
            self._connector.bad_start = None
            mask = self.engine.retrieve(_KeyChain(hashes, [size] * len(hashes)), kv_cache=kv_cache,
                                        slot_mapping=table)  # a block table: see lmcache_connector
            bad = self._connector.bad_start
        flags = mask.tolist()
        for c in range(len(hashes)):
            start, end = c * size, (c + 1) * size
            if not (flags[start] and flags[end - 1]) or (bad is not None and end > bad):
                return c
        return len(hashes)

    # ---- lookup -----------------------------------------------------------------------------
    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        C = self.chunk_blocks
        hashes = [chunk_hash(keys[p]) for p in range(C - 1, len(keys), C)]
        # offsets of 1 make LMCache's answer (tokens covered) a count of chunks.
        chunks = int(self.engine.lookup(hashes=hashes, offsets=[1] * len(hashes))) if hashes else 0
        found = chunks * C
        if found == len(keys):
            return found
        try:
            return found + self.tail.lookup_prefix(keys[found:])
        except KVStoreError:
            if not found:
                raise
            return found

    def shared_prefix(self, keys: Sequence[bytes]) -> int:
        """Whole leading chunks in Redis itself, not only in this node's local tiers (after a
        Redis restart those still answer lookup_prefix, and skipping their put would leave
        every other node missing them). Rounded to chunks, so a put from there stays aligned."""
        C = self.chunk_blocks
        hashes = [chunk_hash(keys[p]) for p in range(C - 1, len(keys), C)]
        backends = remote_backends(self.engine)
        if not hashes or not backends:
            return 0
        chunk_keys = [key for _, _, key in self.engine.token_database.process_tokens(
            hashes=hashes, offsets=[1] * len(hashes))]
        return leading_keys_present(backends[0], chunk_keys) * C

    # A state slot is no chunk of tokens: it goes through the tail store's one value per key.
    def put_state(self, key: bytes, arena: torch.Tensor, slot: int) -> None:
        self.tail.put_state(key, arena, slot)

    def get_state(self, key: bytes, arena: torch.Tensor, slot: int) -> bool:
        return self.tail.get_state(key, arena, slot)

    def has_states(self, keys: Sequence[bytes]) -> list[bool]:
        return self.tail.has_states(keys)

    @property
    def integrity_failures(self) -> int:
        own = self._digests.failures if self._digests is not None else 0
        return own + self.tail.integrity_failures

    def close(self) -> None:
        if self._digests is not None:
            self._digests.close()
        self.tail.close()
        engine, self._engine = self._engine, None
        if engine is not None:
            close_in_daemon(engine, self.instance_id, self.close_timeout_s)
