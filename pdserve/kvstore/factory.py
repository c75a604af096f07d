"""make_store(url): pick a KV store backend from a URL.

    memory://[?max_gb=G]                  in-process LRU (MemoryKVStore)
    redis://host:port[/db][?ttl_s=S]      the default Redis path: direct Redis (RedisKVStore)
    direct+redis://host:port[/db]         direct Redis, named explicitly
    rediss://host:port[?ca_file=PATH]     direct Redis over TLS (also direct+rediss://); the
                                          server certificate and hostname are always verified,
                                          against ca_file or else the system CAs
    lmcache+redis://host:port[?local_cpu_gb=G]
                                          LMCache: local CPU tier in front of Redis

redis:// means direct Redis: for the same 64 x 256 KiB blocks (benchmarks/bench_kvstore.py)
it put at ~0.8-1.0 GB/s and read back from Redis at ~0.45-0.55 GB/s, against LMCache's
~0.2-0.55 and ~0.2-0.25 GB/s (LMCache writes two keys per block and reads them with two GETs
per block; direct is one pipelined SET / one MGET per batch). It also verifies a checksum and
reports a dead server as KVStoreError. lmcache+redis:// wins only on hits in its in-process CPU
tier (~1-3 GB/s); blocks handed from a prefill node to a decode node always come from Redis.

Redis AUTH goes in the URL as redis-py reads it: redis://:password@host:port or
redis://user:password@host:port (percent-encode reserved characters, e.g. "@" as %40). A wrong or
missing password, or a failed TLS handshake, reads like a dead server: KVStoreError on each call,
and the nodes recompute. Stores keep only the redacted URL (redact_url), so no log shows it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

if TYPE_CHECKING:  # annotations only: the launcher imports redact_url and must not load torch
    from pdserve.kvstore.base import KVStore
    from pdserve.kvstore.layout import KVLayout

SUPPORTED_SCHEMES = ("memory", "redis", "rediss", "direct+redis", "direct+rediss", "lmcache+redis")


def redact_url(url: str) -> str:
    """url with its password replaced by "***": the form that may appear in logs and errors."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL we can parse (e.g. a bad port): hide everything before "@"
        return url if "@" not in url else url.split("://", 1)[0] + "://***@" + url.rpartition("@")[2]
    if password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def _query(url: str) -> tuple[str, dict[str, str]]:
    """Split off the query: its options are ours, not redis-py's (which would reject them)."""
    parts = urlsplit(url)
    options = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    return urlunsplit(parts._replace(query="")), options


def _redis_url(url: str) -> str:
    """The redis:// (or, for TLS, rediss://) URL under a "direct+redis(s)://" or
    "lmcache+redis://" scheme; credentials in it pass through untouched."""
    scheme, rest = url.split("://", 1)
    return ("rediss://" if scheme.lower().endswith("rediss") else "redis://") + rest


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
    if scheme in ("redis", "rediss", "direct+redis", "direct+rediss"):
        from pdserve.kvstore.redis_store import RedisKVStore
        if "ttl_s" in options:
            kwargs.setdefault("ttl_s", float(options["ttl_s"]))
        if "ca_file" in options:
            kwargs.setdefault("ca_file", options["ca_file"])
        return RedisKVStore(_redis_url(base), **kwargs)
    if scheme == "lmcache+redis":
        if layout is None:
            raise ValueError("lmcache+redis:// needs layout=KVLayout(...)")
        # Imported here: lmcache is an optional dependency and slow to import.
        from pdserve.kvstore.lmcache_store import LMCacheKVStore
        if "local_cpu_gb" in options:
            kwargs.setdefault("local_cpu_gb", float(options["local_cpu_gb"]))
        return LMCacheKVStore(layout, _redis_url(base), **kwargs)
    raise ValueError(f"unsupported KV store URL {redact_url(url)!r}; supported schemes: "
                     + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES))
