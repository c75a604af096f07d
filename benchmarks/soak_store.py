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

from pdserve.testing.redis_cluster import NODE_TIMEOUT_MS, REDIS_CLI, REDIS_SERVER, _ports
from pdserve.wire.transport import free_port

# the store's URL scheme per transport: LMCache's tiers over Redis, pdserve's direct Redis
# client, or pdserve's client for a Redis Cluster
SCHEMES = {"store": "redis://", "direct-store": "direct+redis://", "cluster-store": "redis-cluster://"}
CLUSTER_SERVERS, CLUSTER_REPLICAS = 6, 1


def _cli(port: int, *args: str) -> str:
    try:
        return subprocess.run([REDIS_CLI, "-p", str(port), *args], capture_output=True, text=True, timeout=5).stdout
    except subprocess.TimeoutExpired:  # a SIGSTOPped server
        return ""


class SoakRedis:
    def __init__(self, transport: str, workdir: Path):
        self.transport, self.cluster = transport, transport == "cluster-store"
        ports = _ports(CLUSTER_SERVERS) if self.cluster else [free_port()]
        self.ports = {f"redis-{i}" if self.cluster else "redis": port for i, port in enumerate(ports)}
        self.workdir = workdir

    @property
    def url(self) -> str:
        return SCHEMES[self.transport] + ",".join(f"127.0.0.1:{p}" for p in self.ports.values())

    def commands(self) -> dict[str, list[str]]:
        """Each server's command line, by process name."""
        base = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--loglevel", "warning"]
        out = {}
        for name, port in self.ports.items():
            cluster = ["--cluster-enabled", "yes", "--cluster-config-file", str(self.workdir / f"{name}-nodes.conf"),
                       "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-replica-validity-factor", "0",
                       "--dir", str(self.workdir)] if self.cluster else []
            out[name] = [REDIS_SERVER, "--port", str(port), *base, *cluster]
        return out

    def form(self, timeout_s: float = 60) -> None:
        """Once every server answers: a Redis Cluster is created and waited for."""
        deadline = time.monotonic() + timeout_s
        while not all(_cli(p, "ping").strip() == "PONG" for p in self.ports.values()):
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.1)
        if not self.cluster:
            return
        out = subprocess.run([REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports.values()),
                              "--cluster-replicas", str(CLUSTER_REPLICAS), "--cluster-yes"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
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
        return all("cluster_state:ok" in _cli(p, "cluster", "info") for p in self.ports.values())

    def target(self, rng: random.Random) -> str:
        """The server a fault hits: the one, or a master of the cluster as a live server sees it
        (its replica takes over)."""
        if not self.cluster:
            return "redis"
        by_port = {port: name for name, port in self.ports.items()}
        for port in self.ports.values():
            masters = [int(f[1].split("@")[0].rsplit(":", 1)[1]) for f in map(str.split, _cli(port, "cluster", "nodes")
                                                                             .splitlines())
                       if len(f) > 8 and "master" in f[2] and "fail" not in f[2]]
            if masters:
                return by_port[rng.choice(sorted(masters))]
        return rng.choice(sorted(self.ports))
