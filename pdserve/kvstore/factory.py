"""make_store(url): pick a KV store backend from a URL (docs/kv-store.md lists them).

    redis://host:port[?chunk_tokens=N&local_cpu_gb=G&local_disk=DIR&local_disk_gb=G]
                          the default: LMCache tiers (local CPU -> local disk -> Redis through
                          LMCache's native resp:// client) holding whole chunks of blocks; the
                          trailing partial chunk goes block by block through direct Redis
    lmcache://host:port, lmcache+redis://host:port       the same store, named explicitly
    redis-cluster://host1:port1,host2:port2,...          the same tiers over a Redis Cluster
                          (LMCache's cluster connector): chunks, the partial-chunk tail and the
                          digest ledger are sharded over its masters, and survive a failover
    direct+redis://host:port[/db][?ttl_s=S]              direct Redis (RedisKVStore): one
                          pipelined SET / MGET per batch, a checksum in every value
    rediss://host:port[?ca_file=PATH], direct+rediss://  direct Redis over TLS (resp:// has no
                          TLS); the server certificate and hostname are always verified
    redis://:password@host:port, redis://user:password@host:port
                          direct Redis: a rejected password must read as KVStoreError on every
                          call (LMCache swallows remote errors, so it would read as silent misses)
    memory://[?max_gb=G]  in-process LRU (MemoryKVStore)

An LMCache config file (lmcache_config=PATH, or LMCACHE_CONFIG_FILE) replaces the tier options;
the URL's host fills in its remote_url if it has none. Options the LMCache path cannot honour
(ttl_s, a db number) are refused with a pointer to direct+redis://.

Passwords are percent-encoded in the URL as redis-py reads them. Stores keep only the redacted
URL (redact_url), so no log shows one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

from pdserve.kvstore.redact import redact_url
from pdserve.kvstore.redis_cluster import CLUSTER_SCHEME

if TYPE_CHECKING:  # annotations only: importing this module must not load torch
    from pdserve.kvstore.base import KVStore
    from pdserve.kvstore.layout import KVLayout

SUPPORTED_SCHEMES = ("memory", "redis", "rediss", "direct+redis", "direct+rediss", "lmcache", "lmcache+redis",
                     "redis-cluster")
LMCACHE_SCHEMES = ("redis", "lmcache", "lmcache+redis", "redis-cluster")
LMCACHE_OPTIONS = ("chunk_tokens", "local_cpu_gb", "local_disk", "local_disk_gb", "lmcache_config")


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


def _direct(base: str, options: dict[str, str], kwargs: dict[str, Any]) -> KVStore:
    from pdserve.kvstore.redis_store import RedisKVStore  # deferred: loads torch, which this module must not
    if "ttl_s" in options:
        kwargs.setdefault("ttl_s", float(options["ttl_s"]))
    if "ca_file" in options:
        kwargs.setdefault("ca_file", options["ca_file"])
    return RedisKVStore(_redis_url(base), **kwargs)


def _tier_options(options: dict[str, str], kwargs: dict[str, Any]) -> Any:
    from pdserve.kvstore.lmcache_config import TierOptions  # optional dependency: lmcache (the pdserve[lmcache] extra)
    fields = {"chunk_tokens": int, "local_cpu_gb": float, "local_disk": str, "local_disk_gb": float}
    values = {}
    for name, cast in fields.items():  # kwargs win over the URL's query options
        value = kwargs.pop(name, None)
        value = options.get(name) if value is None else value
        if value is not None:
            values[name] = cast(value)
    return TierOptions(**values)


def _lmcache(base: str, options: dict[str, str], layout: KVLayout | None, kwargs: dict[str, Any]) -> KVStore:
    if "ca_file" in options:  # a CA with plain TCP means the operator believes they have TLS
        raise ValueError("ca_file is a TLS option: use rediss:// (LMCache's resp:// client has no TLS)")
    if layout is None:
        raise ValueError(f"{redact_url(base)}: the LMCache store needs layout=KVLayout(...)")
    parts = urlsplit(base)
    if "ttl_s" in options or parts.path.strip("/") not in ("", "0"):
        raise ValueError("ttl_s and a db number are direct-client options: use direct+redis://")
    try:  # imported here: lmcache is slow to import, and the launcher imports this module
        from pdserve.kvstore.lmcache_config import build_config, config_file_from_env  # optional dependency: lmcache
        from pdserve.kvstore.lmcache_store import LMCacheKVStore  # optional dependency: lmcache
    except ImportError as exc:
        raise ValueError(f"{redact_url(base)} is the LMCache store, which needs lmcache>=0.5.6 "
                         f"(pip install 'pdserve[lmcache]'); or use direct+redis:// ({exc})") from exc
    from pdserve.kvstore.memory_store import MemoryKVStore  # deferred: loads torch, which this module must not
    from pdserve.kvstore.redis_store import RedisKVStore  # deferred: loads torch, which this module must not
    config_file = config_file_from_env(kwargs.pop("lmcache_config", None) or options.get("lmcache_config"))
    tiers = _tier_options(options, kwargs)
    cluster = parts.scheme.lower() == CLUSTER_SCHEME
    remote = f"{CLUSTER_SCHEME if cluster else 'resp'}://{parts.netloc}" if parts.netloc else None
    config = build_config(layout, remote, tiers, config_file)
    host = urlsplit(str(config.remote_url)).netloc if config.remote_url else ""
    tail_scheme = CLUSTER_SCHEME if str(config.remote_url).startswith(f"{CLUSTER_SCHEME}://") else "redis"
    redis_url = f"{tail_scheme}://{host}" if host else None  # the tail and the ledger: the same servers
    tail = RedisKVStore(redis_url) if redis_url else MemoryKVStore()
    return LMCacheKVStore(layout, config, tail=tail, ledger_url=redis_url, **kwargs)


def make_store(url: str, *, layout: KVLayout | None = None, **kwargs: Any) -> KVStore:
    """Build the store named by url. kwargs go to the backend (e.g. prefix=, ttl_s= for direct
    Redis; chunk_tokens=, local_cpu_gb=, local_disk=, local_disk_gb=, lmcache_config= for
    LMCache) and win over URL query options. The LMCache store needs layout (it sizes chunks
    and checks values against it)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    base, options = _query(url)
    if scheme in LMCACHE_SCHEMES and scheme != CLUSTER_SCHEME and _has_password(base):
        scheme = "direct+redis"  # see the module docstring: AUTH goes through the direct client
    if scheme not in LMCACHE_SCHEMES:  # node flags that only the LMCache store reads
        for name in LMCACHE_OPTIONS:
            kwargs.pop(name, None)
    if scheme == "memory":
        from pdserve.kvstore.memory_store import MemoryKVStore  # deferred: loads torch, which this module must not
        max_gb = float(kwargs.pop("max_gb", options.get("max_gb", 1.0)))
        return MemoryKVStore(max_bytes=int(max_gb * (1 << 30)), **kwargs)
    if scheme in ("rediss", "direct+redis", "direct+rediss"):
        return _direct(base, options, kwargs)
    if scheme in LMCACHE_SCHEMES:
        return _lmcache(base, options, layout, kwargs)
    raise ValueError(f"unsupported KV store URL {redact_url(url)!r}; supported schemes: "
                     + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES))


def _has_password(url: str) -> bool:
    try:
        return urlsplit(url).password is not None
    except ValueError:
        return False
