"""LMCache's rough edges, contained: everything here works around lmcache 0.5.6 behaviour.

Import lmcache only through this module (it sets the environment lmcache reads at import).

* Usage tracking: LMCACHE_TRACK_USAGE=false, or it tries to send usage statistics out.
* Logging: each lmcache module logger gets its own handler with propagate=False and INFO level,
  plus opentelemetry's deprecated LoggingHandler (a DeprecationWarning per logger);
  quiet_lmcache_logs() routes them through the application's logging config at WARNING.
* Multiprocessing: LMCacheEngine.__init__ forces the process-wide start method to "spawn";
  keep_start_method() puts back the application's.
* Shutdown: with a Redis remote, LMCacheEngineBuilder.destroy() hung for over 90 s
  (RedisConnector.close() runs the blocking pq_executor.shutdown() on the event-loop thread and
  deadlocks it; that thread is not a daemon). shutdown_engine() closes the remote connections on
  the loop itself, replaces RemoteBackend.close with a no-op, and the caller runs it in a daemon
  thread with a timeout. The local disk tier's LocalDiskWorker.close() blocks the same way
  (pq_executor.shutdown(wait=True) on a loop that no longer runs it): its executor is shut
  down on the loop too, and the worker marked closed.
* Remote writes in flight: RemoteBackend.batched_submit_put_task never adds its keys to
  put_tasks (it only removes them), so nothing says when a batch reached Redis;
  track_batched_puts() makes it record them so put() can wait until other nodes can read them.
* resp:// never reconnects: its native client (lmcache.lmcache_redis) keeps a dead socket after
  a Redis restart and fails every call with "socket writev failed". ReconnectingRESPClient
  rebuilds it (at most once a second) after a failed call.
* resp:// sync calls can hang forever: RESPClient's *_sync methods submit to the native client
  and only then register the future, while the event loop thread drains completions; a reply
  that lands in between is dropped (seen: lookup() stuck in batch_exists_sync). The wrapper
  runs them as the async methods on the loop (submit and register happen there together),
  with a timeout.
"""
from __future__ import annotations

import os

# Both must be set before lmcache is imported: it reads them at import / logger creation.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import logging  # noqa: E402
import multiprocessing  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any


@contextlib.contextmanager
def quiet_logger_setup() -> Iterator[None]:
    """LMCache attaches opentelemetry's deprecated LoggingHandler to every logger it creates
    (at import and while building an engine), each raising a DeprecationWarning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LoggingHandler.*deprecated", category=DeprecationWarning)
        yield


with quiet_logger_setup():
    from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder  # noqa: F401
    from lmcache.v1.config import LMCacheEngineConfig  # noqa: F401
    from lmcache.v1.gpu_connector import GPUConnectorInterface  # noqa: F401
    from lmcache.v1.memory_management import MemoryObj  # noqa: F401
    from lmcache.v1.metadata import LMCacheMetadata  # noqa: F401
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend
    from lmcache.v1.token_database import ChunkedTokenDatabase  # noqa: F401

logger = logging.getLogger(__name__)


def quiet_lmcache_logs() -> None:
    """Route LMCache's loggers through the application's logging config at WARNING."""
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger) and (name == "lmcache" or name.startswith("lmcache.")):
            lg.handlers.clear()
            lg.propagate = True
            lg.setLevel(logging.WARNING)
    # Warnings with nothing to act on: LMCache's own token hashing (pdserve passes its block
    # keys), remote_url's deprecation, and the allocator's "no memory is available" logged on
    # every full-tier allocation just before LRU eviction makes room.
    for name in ("lmcache.v1.token_database", "lmcache.v1.storage_backend.local_cpu_backend",
                 "lmcache.v1.storage_backend", "lmcache.v1.memory_management"):
        logging.getLogger(name).setLevel(logging.ERROR)


@contextlib.contextmanager
def keep_start_method() -> Iterator[None]:
    previous = multiprocessing.get_start_method(allow_none=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(previous, force=True)


def remote_backends(engine: Any) -> list[RemoteBackend]:
    manager = engine.storage_manager
    if manager is None:
        return []
    return [b for b in manager.storage_backends.values() if isinstance(b, RemoteBackend)]


def disk_write_queues(engine: Any) -> list[tuple[Any, list]]:
    """(lock, keys still being written) of each local disk tier: a chunk waiting for its disk
    write holds its CPU-tier memory, which a small CPU tier then cannot give to the next chunk."""
    manager = engine.storage_manager
    if manager is None:
        return []
    workers = [getattr(b, "disk_worker", None) for b in manager.storage_backends.values()]
    return [(w.put_lock, w.put_tasks) for w in workers if w is not None and hasattr(w, "put_tasks")]


def leading_keys_present(backend: RemoteBackend, keys: list, timeout_s: float = 5.0) -> int:
    """How many leading keys the remote tier holds, every key asked at once. LMCache's lookup
    asks its Redis and Redis Cluster connectors one key per round trip: on a Redis Cluster that
    added 2-3 ms to a warm prompt's handover, before its first token."""
    conn = backend.connection
    if conn is None or not keys:
        return 0
    if getattr(backend, "_mla_worker_id_as0_mode", False):  # as RemoteBackend.contains does
        keys = [key.with_new_worker_id(0) for key in keys]

    async def each_present() -> list[bool]:
        return await asyncio.gather(*(conn.exists(key) for key in keys))

    try:
        present = asyncio.run_coroutine_threadsafe(each_present(), backend.loop).result(timeout_s)
    except Exception as exc:  # as RemoteBackend.contains: a check that fails finds nothing
        logger.warning("remote existence check failed: %s", exc)
        return 0
    return next((i for i, found in enumerate(present) if not found), len(present))


def track_batched_puts(backend: RemoteBackend) -> None:
    """Make backend.put_tasks list the keys of batched puts in flight (see the docstring)."""
    submit = backend.batched_submit_put_task

    def tracked(keys: Any, memory_objs: Any, *args: Any, **kwargs: Any) -> None:
        conn = backend.connection
        if conn is not None and conn.support_batched_put():  # the per-key fallback tracks itself
            with backend.lock:
                backend.put_tasks.update(keys)
        try:
            submit(keys, memory_objs, *args, **kwargs)
        except BaseException:
            with backend.lock:
                backend.put_tasks.difference_update(keys)
            raise

    backend.batched_submit_put_task = tracked  # type: ignore[method-assign]


class ReconnectingRESPClient:
    """Stands in for RESPConnector.client: forwards every call to lmcache's RESPClient and, when
    one fails, builds a fresh client for the next call (the native one never reconnects)."""

    RETRY_S = 1.0
    SYNC_TIMEOUT_S = 5.0

    def __init__(self, client: Any, rebuild: Any) -> None:
        self._client, self._rebuild = client, rebuild
        self._lock = threading.Lock()
        self._last_rebuild = 0.0

    def _broken(self, failed: Any) -> None:
        with self._lock:
            if self._client is not failed or time.monotonic() - self._last_rebuild < self.RETRY_S:
                return
            self._last_rebuild = time.monotonic()
            try:
                fresh = self._rebuild()
            except Exception as exc:  # server still down: try again on a later failure
                logger.warning("resp:// reconnect failed: %s", exc)
                return
            old, self._client = self._client, fresh
        with contextlib.suppress(Exception):
            old.close()

    def __getattr__(self, name: str) -> Any:
        client = self._client
        if name.endswith("_sync"):
            return self._sync_via_loop(client, name.removesuffix("_sync"))
        attr = getattr(client, name)
        if not callable(attr) or name == "close":
            return attr
        if asyncio.iscoroutinefunction(attr):
            async def call_async(*args: Any, **kwargs: Any) -> Any:
                try:  # bounded: a reply lost to a dead connection must not pin its buffers forever
                    return await asyncio.wait_for(attr(*args, **kwargs), self.SYNC_TIMEOUT_S)
                except Exception:
                    self._broken(client)
                    raise
            return call_async

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except Exception:
                self._broken(client)
                raise
        return call

    def _sync_via_loop(self, client: Any, async_name: str) -> Any:
        method = getattr(client, async_name)

        def call(*args: Any, **kwargs: Any) -> Any:
            future = asyncio.run_coroutine_threadsafe(method(*args, **kwargs), client.loop)
            try:
                return future.result(self.SYNC_TIMEOUT_S)
            except Exception:
                future.cancel()
                self._broken(client)
                raise
        return call

    def close(self) -> None:
        self._client.close()


def reconnect_resp(backend: RemoteBackend) -> None:
    """Wrap the RESP connector's native client (through LMCache's instrumentation wrapper)."""
    from lmcache.v1.storage_backend.connector.redis_connector import RESPConnector  # optional dependency: lmcache
    from lmcache.v1.storage_backend.native_clients.resp_client import RESPClient  # optional dependency: lmcache
    conn = getattr(backend.connection, "_connector", backend.connection)
    if not isinstance(conn, RESPConnector) or isinstance(conn.client, ReconnectingRESPClient):
        return
    native = conn.client
    extra = backend.config.extra_config or {}  # where RESPConnectorAdapter reads AUTH from
    user = str(extra.get("username", "")) or os.environ.get("LMCACHE_RESP_USERNAME", "")
    password = str(extra.get("password", "")) or os.environ.get("LMCACHE_RESP_PASSWORD", "")

    def rebuild() -> Any:
        return RESPClient(conn.host, conn.port, conn.num_threads, conn.loop, user, password)

    conn.client = ReconnectingRESPClient(native, rebuild)


def _disk_workers(engine: Any) -> list[Any]:
    manager = engine.storage_manager
    if manager is None:
        return []
    return [b.disk_worker for b in manager.storage_backends.values() if hasattr(b, "disk_worker")]


async def _close_remotes(backends: list[RemoteBackend], disk_workers: list[Any]) -> None:
    """Runs on the engine's loop: close each remote connection and the disk workers' executors,
    then let the cancelled tasks (the job executors' workers) finish, so none is left pending
    when the loop stops."""
    for worker in disk_workers:
        await worker.executor.shutdown_async(wait=False)
        worker._closed = True  # its close() would block on the executor again
    for backend in backends:
        conn = getattr(backend.connection, "_connector", backend.connection)
        executor = getattr(conn, "pq_executor", None)
        if executor is not None:
            await executor.shutdown_async(wait=False)
        client = getattr(conn, "client", None) or getattr(conn, "connection", None)
        if client is not None and hasattr(client, "aclose"):
            await client.aclose()
        elif client is not None and hasattr(client, "close"):
            with contextlib.suppress(Exception):
                client.close()
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    if others:
        await asyncio.wait(others, timeout=1.0)


def shutdown_engine(engine: Any, instance_id: str, timeout: float) -> None:
    """Close the remote tier ourselves, then let LMCache tear down the rest."""
    manager = engine.storage_manager
    backends, disks = remote_backends(engine), _disk_workers(engine)
    if manager is not None and (backends or disks):
        try:
            asyncio.run_coroutine_threadsafe(_close_remotes(backends, disks), manager.loop).result(timeout)
        except Exception as e:  # a dead server or a stuck loop must not block shutdown
            logger.warning("closing LMCache remote connections: %s", e)
        for backend in backends:
            backend.close = lambda: None  # type: ignore[method-assign]
    LMCacheEngineBuilder.destroy(instance_id)


def close_in_daemon(engine: Any, instance_id: str, timeout: float) -> None:
    t = threading.Thread(target=shutdown_engine, name="pdserve-lmcache-close", daemon=True,
                         args=(engine, instance_id, timeout))
    t.start()
    t.join(timeout)
    if t.is_alive():
        logger.warning("LMCache engine %s still shutting down after %.1fs; moving on", instance_id, timeout)
