"""The soaked cluster's Redis: one server (the store and direct-store transports), or a Redis
Cluster of 3 masters with a replica each (cluster-store), as processes the soak's supervisor
restarts and its faults kill and stop. A cluster server keeps its node file in the soak's
directory, so a restarted one rejoins as the node it was (persistence is off: it comes back
empty, which a KV cache tolerates)."""
from __future__ import annotations

import random
import subprocess
import time
from pathlib import Path

import redis

from pdserve.testing.redis_cluster import (
    REDIS_SERVER,
    cli,
    cluster_ok,
    create_cluster,
    free_ports,
    masters_seen_by,
    server_command,
)
from pdserve.wire.transport import free_port

# the store's URL scheme per transport: LMCache's tiers over Redis, pdserve's direct Redis
# client, or pdserve's client for a Redis Cluster
SCHEMES = {"store": "redis://", "direct-store": "direct+redis://", "cluster-store": "redis-cluster://"}
CLUSTER_SERVERS, CLUSTER_REPLICAS = 6, 1
CLI_TIMEOUT_S = 5  # a SIGSTOPped server answers nothing: count it as not up, and move on


def _answers(default, ask, *args):
    """ask(*args) of a server that may be stopped: default if it does not answer in time."""
    try:
        return ask(*args, timeout=CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return default


class SoakRedis:
    def __init__(self, transport: str, workdir: Path):
        self.transport, self.cluster = transport, transport == "cluster-store"
        ports = free_ports(CLUSTER_SERVERS) if self.cluster else [free_port()]
        self.ports = {f"redis-{i}" if self.cluster else "redis": port for i, port in enumerate(ports)}
        self.workdir = workdir

    @property
    def url(self) -> str:
        return SCHEMES[self.transport] + ",".join(f"127.0.0.1:{p}" for p in self.ports.values())

    def commands(self) -> dict[str, list[str]]:
        """Each server's command line, by process name (the launcher's for one server)."""
        if self.cluster:
            return {name: server_command(port, str(self.workdir)) for name, port in self.ports.items()}
        return {"redis": [REDIS_SERVER, "--port", str(self.ports["redis"]), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--loglevel", "warning"]}

    def form(self, timeout_s: float = 60) -> None:
        """Once every server answers: a Redis Cluster is created and waited for."""
        deadline = time.monotonic() + timeout_s
        while not all(_answers("", cli, p, "ping").strip() == "PONG" for p in self.ports.values()):
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.1)
        if not self.cluster:
            return
        create_cluster(self.ports.values(), CLUSTER_REPLICAS)
        while not self.up():
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.2)

    def up(self) -> bool:
        """Every server answers (a cluster: each says cluster_state:ok)."""
        if not self.cluster:
            try:
                port = self.ports["redis"]
                return bool(redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2).ping())
            except redis.RedisError:
                return False
        return all(_answers(False, cluster_ok, p) for p in self.ports.values())

    def target(self, rng: random.Random) -> str:
        """The server a fault hits: the one, or a master of the cluster as a live server sees it
        (its replica takes over)."""
        if not self.cluster:
            return "redis"
        by_port = {port: name for name, port in self.ports.items()}
        for port in self.ports.values():
            masters = _answers([], masters_seen_by, port)
            if masters:
                return by_port[rng.choice(masters)]
        return rng.choice(sorted(self.ports))
