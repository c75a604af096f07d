"""Redis clients for one server or a Redis Cluster, chosen by URL.

    redis-cluster://[user:password@]host1:port1,host2:port2,...

names any nodes of a Redis Cluster (the client discovers the rest and follows the slot map, and a
replica promoted after its master died). The LMCache store hands the same URL to LMCache's own
cluster connector for whole chunks, and to these clients for the partial-chunk tail and the
digest ledger, so all three live in one cluster. Multi-key reads go slot by slot
(mget_nonatomic): one MGET may not span slots on a cluster.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

CLUSTER_SCHEME = "redis-cluster"
# What a Redis call may raise: the cluster client's own errors (no slot covered, too many
# redirections) are not RedisErrors.
REDIS_ERRORS = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException)
# How many times a cluster command follows MOVED/ASK or a failed node before it gives up: enough
# to ride out a failover (a replica takes over within the cluster's node timeout).
CLUSTER_RETRIES = 5


def is_cluster_url(url: str) -> bool:
    return url.lower().startswith(f"{CLUSTER_SCHEME}://")


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """(host, port) of each node named, and the username and password if any."""
    rest = url.split("://", 1)[1].split("?", 1)[0].strip("/")
    username = password = None
    if "@" in rest:
        auth, rest = rest.rsplit("@", 1)
        username, _, password = auth.partition(":")
        username, password = unquote(username) or None, unquote(password) or None
    nodes = []
    for part in filter(None, rest.split(",")):
        host, sep, port = part.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"{CLUSTER_SCHEME}:// needs host:port for every node, got {part!r}")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise ValueError(f"{CLUSTER_SCHEME}:// names no node")
    return nodes, username, password


def redis_client(url: str, **options: Any) -> redis.Redis | RedisCluster:
    """redis.Redis for redis:// and rediss://, RedisCluster for redis-cluster://."""
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **options)
    nodes, username, password = parse_cluster_url(url)
    options["retry"] = Retry(ExponentialBackoff(cap=1.0, base=0.1), CLUSTER_RETRIES)
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], username=username, password=password,
                        **options)


def mset(client: redis.Redis | RedisCluster, mapping: dict[bytes, bytes]) -> None:
    if isinstance(client, RedisCluster):
        client.mset_nonatomic(mapping)
    else:
        client.mset(mapping)


def mget(client: redis.Redis | RedisCluster, names: Sequence[bytes]) -> list[bytes | None]:
    if isinstance(client, RedisCluster):
        return client.mget_nonatomic(list(names))
    return client.mget(names)


def initialize_lmcache_cluster(backend, timeout_s: float = 10.0) -> None:
    """Connect LMCache's cluster connector (if the backend has one) on its own loop before any
    use: redis-py's asyncio RedisCluster, first used by many coroutines at once (a batched put),
    fails them with "'NoneType' object has no attribute 'writelines'"; once initialized it
    serves them concurrently (checked with redis-py 8.1.0)."""
    conn = getattr(backend.connection, "_connector", backend.connection)
    cluster = getattr(conn, "cluster", None)
    if cluster is not None and hasattr(cluster, "initialize") and getattr(conn, "loop", None) is not None:
        asyncio.run_coroutine_threadsafe(cluster.initialize(), conn.loop).result(timeout_s)
