"""make_store(url): pick a KV store backend from a URL.

    memory://[?max_gb=G]                  in-process LRU (MemoryKVStore)
    redis://host:port[/db][?ttl_s=S]      the default Redis path: direct Redis (RedisKVStore)
    direct+redis://host:port[/db]         direct Redis, named explicitly
    lmcache+redis://host:port[?local_cpu_gb=G]
                                          LMCache: local CPU tier in front of Redis

redis:// means direct Redis: for the same 64 x 256 KiB blocks (benchmarks/bench_kvstore.py)
it put at ~0.8-1.0 GB/s and read back from Redis at ~0.45-0.55 GB/s, against LMCache's
~0.2-0.55 and ~0.2-0.25 GB/s (LMCache writes two keys per block and reads them with two GETs
per block; direct is one pipelined SET / one MGET per batch). It also verifies a checksum and
reports a dead server as KVStoreError. lmcache+redis:// wins only on hits in its in-process CPU
tier (~1-3 GB/s); blocks handed from a prefill node to a decode node always come from Redis.
"""
from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

from pdserve.kvstore.base import KVStore
from pdserve.kvstore.layout import KVLayout

SUPPORTED_SCHEMES = ("memory", "redis", "direct+redis", "lmcache+redis")


def _query(url: str) -> tuple[str, dict[str, str]]:
    """Split off the query: its options are ours, not redis-py's (which would reject them)."""
    parts = urlsplit(url)
    options = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    return urlunsplit(parts._replace(query="")), options


def _redis_url(url: str) -> str:
    """The plain redis:// URL under a "direct+redis://" or "lmcache+redis://" scheme."""
    return "redis://" + url.split("://", 1)[1]


def make_store(url: str, *, layout: KVLayout | None = None, **kwargs: Any) -> KVStore:
    """Build the store named by url. kwargs go to the backend's constructor (e.g. prefix=,
    ttl_s= for Redis; local_cpu_gb= for LMCache) and win over URL query options.
    The LMCache backend needs layout (it sizes chunks and metadata from it)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    base, options = _query(url)
    if scheme == "memory":
        from pdserve.kvstore.memory_store import MemoryKVStore
        max_gb = float(kwargs.pop("max_gb", options.get("max_gb", 1.0)))
        return MemoryKVStore(max_bytes=int(max_gb * (1 << 30)), **kwargs)
    if scheme in ("redis", "direct+redis"):
        from pdserve.kvstore.redis_store import RedisKVStore
        if "ttl_s" in options:
            kwargs.setdefault("ttl_s", float(options["ttl_s"]))
        return RedisKVStore(_redis_url(base), **kwargs)
    if scheme == "lmcache+redis":
        if layout is None:
            raise ValueError("lmcache+redis:// needs layout=KVLayout(...)")
        # Imported here: lmcache is an optional dependency and slow to import.
        from pdserve.kvstore.lmcache_store import LMCacheKVStore
        if "local_cpu_gb" in options:
            kwargs.setdefault("local_cpu_gb", float(options["local_cpu_gb"]))
        return LMCacheKVStore(layout, _redis_url(base), **kwargs)
    raise ValueError(f"unsupported KV store URL {url!r}; supported schemes: "
                     + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES))
