"""LMCache KV store: LMCache's local-CPU tier in front of a Redis remote tier.

How pdserve maps onto LMCache (checked against lmcache 0.5.6):

* One LMCache chunk is one pdserve block (chunk_size = block_size).
* Keys: LMCache's chunk hash is our 16-byte block key read as a 128-bit big-endian int.
  store() and lookup() take it through their hashes=/offsets= arguments, so LMCache's own token
  hashing never runs and the key chain is exactly ours. retrieve() only accepts tokens=, so we
  pass a _KeyChain stand-in for the tokens and install a token database that expands it into the
  same hashes/offsets. In Redis a block lands under "<model>@1@0@<hash hex>@<dtype>" with the
  suffixes "kv_bytes" and "metadata" (LMCache's own struct header, no pickle).
* Partial trailing blocks: the hashes= path takes each chunk's length from offsets=, so a block
  of n < block_size tokens is stored as an n-token chunk under its own key, whatever
  save_unfull_chunk says (that flag only gates LMCache's token chunking, which we bypass). We
  set it True anyway so the two paths agree.
* The connector moves tokens [start, end) between a MemoryObj ([2, layers, n, heads*dim]) and
  the block-major cache; store/retrieve pass it kv_cache= and slot_mapping= (token position ->
  block_id * block_size + offset).
* put() returns once the blocks are in Redis (other nodes read them from there). LMCache writes
  to the remote in the background and its batched path never records what is in flight, so we
  make it record keys in RemoteBackend.put_tasks and wait for them to clear.
* Every stored or fetched block is staged in the CPU tier (allocated and touched up front:
  local_cpu_gb of RSS), and one call drops whatever does not fit. put()/get() go in slices of
  at most a quarter of the tier so LRU eviction can make room between them.
* A dead Redis reads as a miss (LMCache swallows remote errors): 0, not KVStoreError.
* close() avoids LMCache's own shutdown of the remote tier: RedisConnector.close() runs the
  blocking pq_executor.shutdown() on the event-loop thread and deadlocks it, and that thread is
  not a daemon, so the process could not exit. We close the connection ourselves, then destroy
  the engine in a daemon thread with a timeout.
* LMCacheEngine() sets the multiprocessing start method to "spawn" process-wide; we restore it.
* Integrity: LMCache checks no payload, so put() also records each block's digest in Redis and
  get() keeps only the leading blocks whose bytes match (digest_ledger.py).
"""
from __future__ import annotations

import os

# Both must be set before lmcache is imported: it reads them at import / logger creation.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # else it sends usage stats out
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # INFO logs every store/retrieve

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import logging  # noqa: E402
import multiprocessing  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
import warnings  # noqa: E402
from typing import Any, Iterator, Sequence  # noqa: E402

import torch  # noqa: E402


@contextlib.contextmanager
def _quiet_logger_setup() -> Iterator[None]:
    """LMCache attaches opentelemetry's deprecated LoggingHandler to every logger it creates
    (at import and while building an engine), each raising a DeprecationWarning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LoggingHandler.*deprecated",
                                category=DeprecationWarning)
        yield


with _quiet_logger_setup():
    from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import GPUConnectorInterface
    from lmcache.v1.memory_management import MemoryObj
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend
    from lmcache.v1.token_database import ChunkedTokenDatabase

from pdserve.kvstore.base import KVStore  # noqa: E402
from pdserve.kvstore.digest_ledger import DigestLedger  # noqa: E402
from pdserve.kvstore.layout import KVLayout, check_batch  # noqa: E402

logger = logging.getLogger(__name__)


def quiet_lmcache_logs() -> None:
    """Route LMCache's loggers through the application's logging config at WARNING.
    LMCache gives each module logger its own handler with propagate=False; undo that."""
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger) and (name == "lmcache" or name.startswith("lmcache.")):
            lg.handlers.clear()
            lg.propagate = True
            lg.setLevel(logging.WARNING)
    # Warnings with nothing to act on: ones about LMCache's own token hashing (PYTHONHASHSEED,
    # vLLM hash functions), which pdserve never uses since keys come from
    # pdserve.engine.block_keys; the cache controller we do not run; remote_url's deprecation;
    # and the allocator's "no memory is available", logged on every full-tier allocation just
    # before LRU eviction makes room (a real failure is still reported by the cache engine).
    for name in ("lmcache.v1.token_database", "lmcache.v1.storage_backend.local_cpu_backend",
                 "lmcache.v1.storage_backend", "lmcache.v1.memory_management"):
        logging.getLogger(name).setLevel(logging.ERROR)


def chunk_hash(key: bytes) -> int:
    """LMCache chunk hash for one of our block keys (all 128 bits, so no extra collisions)."""
    return int.from_bytes(key, "big")


def slot_mapping(block_ids: Sequence[int], num_tokens: Sequence[int], block_size: int) -> list[int]:
    return [b * block_size + t for b, n in zip(block_ids, num_tokens) for t in range(n)]


class _KeyChain:
    """Stands in for `tokens` in LMCacheEngine.retrieve(), which has no hashes= argument: it has
    the token count retrieve() needs for len() and carries our hashes to the token database."""

    def __init__(self, hashes: list[int], offsets: list[int]) -> None:
        self.hashes, self.offsets = hashes, offsets

    def __len__(self) -> int:
        return sum(self.offsets)


class _BlockKeyTokenDatabase(ChunkedTokenDatabase):
    """Expands a _KeyChain into LMCache's hashes/offsets path; anything else goes on as usual."""

    def process_tokens(self, tokens: Any = None, hashes: Any = None, offsets: Any = None,
                       mask: Any = None, make_key: bool = True,
                       request_configs: dict | None = None) -> Any:
        if isinstance(tokens, _KeyChain):
            return super().process_tokens(hashes=tokens.hashes, offsets=tokens.offsets,
                                          make_key=make_key, request_configs=request_configs)
        return super().process_tokens(tokens, hashes, offsets, mask, make_key, request_configs)


class PagedBlockConnector(GPUConnectorInterface):
    """Copies between LMCache MemoryObjs ([2, layers, n, heads*dim], format KV_2LTD) and
    pdserve's cache [blocks, layers, 2, block_size, heads, dim]. kwargs: kv_cache, slot_mapping.
    Plain torch copies, so it works for CPU and GPU caches alike."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        # Smallest chunk start whose MemoryObj did not fit its slot during the last load
        # (e.g. a key stored as a partial block requested as a full one); get() stops there.
        self.bad_start: int | None = None

    def get_shape(self, num_tokens: int) -> torch.Size:
        lay = self.layout
        return torch.Size([2, lay.num_layers, num_tokens, lay.num_kv_heads * lay.head_dim])

    def _slot_view(self, kwargs: dict, start: int, end: int) -> torch.Tensor:
        """kv_cache[b, :, :, off:off+n] for the chunk's tokens; they must sit in one block."""
        slots, bs = kwargs["slot_mapping"], self.layout.block_size
        first, last = int(slots[start]), int(slots[end - 1])
        block, off = divmod(first, bs)
        if last != first + (end - start) - 1 or off + (end - start) > bs:
            raise ValueError(f"chunk [{start},{end}) does not map to one contiguous block")
        return kwargs["kv_cache"][block, :, :, off:off + end - start]

    def _obj_view(self, memory_obj: MemoryObj, n: int) -> torch.Tensor | None:
        t = memory_obj.tensor
        lay = self.layout
        if t is None or t.dtype != lay.dtype or tuple(t.shape) != tuple(self.get_shape(n)):
            return None
        return t.view(2, lay.num_layers, n, lay.num_kv_heads, lay.head_dim)

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        dst = self._obj_view(memory_obj, end - start)
        if dst is None:
            raise ValueError(f"LMCache allocated an unexpected MemoryObj for [{start},{end})")
        dst.copy_(self._slot_view(kwargs, start, end).transpose(0, 1))

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        src = self._obj_view(memory_obj, end - start)
        if src is None:
            self.bad_start = start if self.bad_start is None else min(self.bad_start, start)
            return
        self._slot_view(kwargs, start, end).copy_(src.transpose(0, 1))

    def batched_from_gpu(self, memory_objs: Any, starts: list[int], ends: list[int],
                         **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Any = None, starts: list[int] | None = None,
                       ends: list[int] | None = None, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs or [], starts or [], ends or []):
            self.to_gpu(obj, start, end, **kwargs)


def _no_broadcast(*_args: Any, **_kwargs: Any) -> Any:
    """Single worker: nothing to broadcast (only used by LMCache's multi-rank MLA mode)."""
    return None


def build_engine(layout: KVLayout, connector: PagedBlockConnector, remote_url: str | None,
                 local_cpu_gb: float, instance_id: str, blocking_timeout_s: int) -> LMCacheEngine:
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=layout.block_size, local_cpu=True, max_local_cpu_size=local_cpu_gb,
        remote_url=remote_url, remote_serde="naive", save_unfull_chunk=True,
        py_enable_gc=True, blocking_timeout_secs=blocking_timeout_s)
    metadata = LMCacheMetadata(
        model_name=layout.model_name, world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=layout.dtype,
        kv_shape=(layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim),
        chunk_size=layout.block_size)
    # LMCacheEngine.__init__ forces the process-wide multiprocessing start method to "spawn";
    # put back whatever the application had, since pdserve's own process handling may rely on it.
    previous = multiprocessing.get_start_method(allow_none=True)
    try:
        with _quiet_logger_setup():
            engine = LMCacheEngineBuilder.get_or_create(instance_id, config, metadata, connector,
                                                        _no_broadcast, _no_broadcast)
            try:
                engine.token_database = _BlockKeyTokenDatabase(config, metadata)
                engine.post_init()  # creates the storage backends; store() asserts without it
                for backend in _remote_backends(engine):
                    _track_batched_puts(backend)
            except BaseException:
                # post_init may already run the (non-daemon) event-loop thread: stop it, or
                # the process could never exit.
                shutdown_engine(engine, instance_id, timeout=2.0)
                raise
    finally:
        multiprocessing.set_start_method(previous, force=True)
        quiet_lmcache_logs()  # again: post_init imports modules that made new loggers
    return engine


def _track_batched_puts(backend: RemoteBackend) -> None:
    """Make backend.put_tasks list the keys of batched puts in flight, as it already does for
    single puts: RemoteBackend.batched_submit_put_task removes keys from put_tasks when a batch
    completes but never adds them, so nothing tells when a batch reached Redis. put() waits on
    this set."""
    submit = backend.batched_submit_put_task

    def tracked(keys: Any, memory_objs: Any, *args: Any, **kwargs: Any) -> None:
        conn = backend.connection
        # Only the batched path: the per-key fallback skips keys already in put_tasks.
        if conn is not None and conn.support_batched_put():
            with backend.lock:
                backend.put_tasks.update(keys)
        try:
            submit(keys, memory_objs, *args, **kwargs)
        except BaseException:
            with backend.lock:
                backend.put_tasks.difference_update(keys)
            raise

    backend.batched_submit_put_task = tracked  # type: ignore[method-assign]


def _remote_backends(engine: LMCacheEngine) -> list[RemoteBackend]:
    manager = engine.storage_manager
    if manager is None:
        return []
    return [b for b in manager.storage_backends.values() if isinstance(b, RemoteBackend)]


async def _close_remotes(backends: list[RemoteBackend]) -> None:
    """Runs on the engine's loop: close each remote connection, then let the tasks that were
    cancelled (the job executors' workers) finish, so none is left pending when the loop stops."""
    for backend in backends:
        conn = backend.connection
        executor = getattr(conn, "pq_executor", None)
        if executor is not None:
            await executor.shutdown_async(wait=False)
        client = getattr(conn, "connection", None)
        if client is not None and hasattr(client, "aclose"):
            await client.aclose()
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    if others:
        await asyncio.wait(others, timeout=1.0)


def shutdown_engine(engine: LMCacheEngine, instance_id: str, timeout: float) -> None:
    """Close the remote tier ourselves, then let LMCache tear down the rest. RemoteBackend.close
    is replaced by a no-op because it deadlocks the event loop (see the module docstring)."""
    manager = engine.storage_manager
    backends = _remote_backends(engine)
    if manager is not None and backends:
        try:
            asyncio.run_coroutine_threadsafe(_close_remotes(backends), manager.loop).result(timeout)
        except Exception as e:  # a dead server or a stuck loop must not block shutdown
            logger.warning("closing LMCache remote connections: %s", e)
        for backend in backends:
            backend.close = lambda: None  # type: ignore[method-assign]
    LMCacheEngineBuilder.destroy(instance_id)


class LMCacheKVStore(KVStore):
    """KVStore over an LMCacheEngine: local CPU tier (LRU, local_cpu_gb) in front of an optional
    Redis remote (remote_url=None: CPU tier only)."""

    def __init__(self, layout: KVLayout, remote_url: str | None, *, local_cpu_gb: float = 1.0,
                 wait_remote_s: float = 10.0, blocking_timeout_s: int = 5,
                 close_timeout_s: float = 5.0) -> None:
        quiet_lmcache_logs()
        self.layout = layout
        self.remote_url = remote_url
        # put() waits this long for the remote writes LMCache does in the background, so a
        # block is in Redis (readable by other nodes) when put() returns.
        self.wait_remote_s = wait_remote_s
        self.close_timeout_s = close_timeout_s
        # Unique id: the builder caches engines by id, and two stores must not share one.
        self.instance_id = f"pdserve-{uuid.uuid4().hex[:12]}"
        self._connector = PagedBlockConnector(layout)
        self._engine: LMCacheEngine | None = build_engine(
            layout, self._connector, remote_url, local_cpu_gb, self.instance_id,
            blocking_timeout_s)
        # LMCache's engine expects one caller at a time (vLLM drives it from one worker
        # thread), and the connector's bad_start is per load: serialise store/retrieve.
        self._lock = threading.Lock()
        # LMCache stages every block (stored or fetched from Redis) in the CPU tier, and drops
        # what does not fit in one call. Calls of at most a quarter of the tier, waiting for the
        # remote writes in between, let LRU eviction make room instead.
        tier_bytes = int(local_cpu_gb * (1 << 30))
        self.blocks_per_call = max(1, tier_bytes // 4 // layout.block_nbytes())
        self._digests = DigestLedger(remote_url) if remote_url else None

    @property
    def engine(self) -> LMCacheEngine:
        if self._engine is None:
            raise RuntimeError("LMCacheKVStore is closed")
        return self._engine

    def put(self, keys: Sequence[bytes], kv_cache: torch.Tensor, block_ids: Sequence[int],
            num_tokens: Sequence[int]) -> None:
        check_batch(keys, block_ids, num_tokens)
        step = self.blocks_per_call
        for lo in range(0, len(keys), step):
            part = slice(lo, lo + step)
            hashes = [chunk_hash(k) for k in keys[part]]
            slots = slot_mapping(block_ids[part], num_tokens[part], self.layout.block_size)
            with self._lock:
                self.engine.store(hashes=hashes, offsets=list(num_tokens[part]),
                                  kv_cache=kv_cache, slot_mapping=slots)
            if self._digests is not None:
                self._digests.put(keys[part], kv_cache, block_ids[part], num_tokens[part])
            self._wait_remote(set(hashes))

    def _wait_remote(self, hashes: set[int]) -> None:
        deadline = time.monotonic() + self.wait_remote_s
        for backend in _remote_backends(self.engine):
            while True:
                with backend.lock:
                    pending = any(k.chunk_hash in hashes for k in backend.put_tasks)
                if not pending:
                    break
                if time.monotonic() > deadline:
                    logger.warning("LMCache remote writes still pending after %.1fs",
                                   self.wait_remote_s)
                    return
                time.sleep(0.0005)

    def get(self, keys: Sequence[bytes], kv_cache: torch.Tensor, block_ids: Sequence[int],
            num_tokens: Sequence[int]) -> int:
        check_batch(keys, block_ids, num_tokens)
        loaded = 0
        step = self.blocks_per_call
        # Each key names its whole prefix, so a slice of the chain is a valid chain on its own.
        for lo in range(0, len(keys), step):
            part = slice(lo, lo + step)
            got = self._get_part(keys[part], kv_cache, block_ids[part], num_tokens[part])
            loaded += got
            if got < len(keys[part]):
                break
        return loaded

    def _get_part(self, keys: Sequence[bytes], kv_cache: torch.Tensor, block_ids: Sequence[int],
                  num_tokens: Sequence[int]) -> int:
        chain = _KeyChain([chunk_hash(k) for k in keys], list(num_tokens))
        slots = torch.tensor(slot_mapping(block_ids, num_tokens, self.layout.block_size),
                             dtype=torch.long)
        with self._lock:
            self._connector.bad_start = None
            mask = self.engine.retrieve(chain, kv_cache=kv_cache, slot_mapping=slots)
            bad = self._connector.bad_start
        loaded = _leading_loaded(mask, num_tokens, bad)
        if self._digests is None:
            return loaded
        return self._digests.verified(keys[:loaded], kv_cache, block_ids[:loaded], num_tokens[:loaded])

    @property
    def integrity_failures(self) -> int:
        return self._digests.failures if self._digests is not None else 0

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        # offsets of 1 make LMCache's answer (tokens covered) a count of blocks.
        return int(self.engine.lookup(hashes=[chunk_hash(k) for k in keys],
                                      offsets=[1] * len(keys)))

    def close(self) -> None:
        if self._digests is not None:
            self._digests.close()
        engine, self._engine = self._engine, None
        if engine is None:
            return
        t = threading.Thread(target=shutdown_engine, name="pdserve-lmcache-close", daemon=True,
                             args=(engine, self.instance_id, self.close_timeout_s))
        t.start()
        t.join(self.close_timeout_s)
        if t.is_alive():
            logger.warning("LMCache engine %s still shutting down after %.1fs; moving on",
                           self.instance_id, self.close_timeout_s)


def _leading_loaded(mask: torch.Tensor, num_tokens: Sequence[int], bad_start: int | None) -> int:
    """Blocks at the head of the chain whose tokens were all retrieved and fitted their slot."""
    flags = mask.tolist()
    start = 0
    for i, n in enumerate(num_tokens):
        end = start + n
        if not (flags[start] and flags[end - 1]) or (bad_start is not None and end > bad_start):
            return i
        start = end
    return len(num_tokens)
