"""A throwaway Redis Cluster (Debian's redis-server) for tests and benchmarks.

    with redis_cluster(masters=3, replicas=1) as cluster:
        cluster.url            # redis-cluster://127.0.0.1:P1,127.0.0.1:P2,...
        cluster.masters()      # {port: process} of the current masters
        cluster.kill(port)     # SIGKILL one server (its replica takes over)

Every server binds 127.0.0.1 with persistence off; its cluster bus listens on port + 10000, so
both ports are picked below the kernel's ephemeral range, within free_port's range. A short node
timeout makes a failover take about a second.
"""
from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

from pdserve.wire import port_ledger
from pdserve.wire.transport import port_range

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
NODE_TIMEOUT_MS = 1000
BUS_OFFSET = 10000  # Redis's: a server's cluster bus listens on its port + 10000


def _port_pair_free(port: int) -> bool:
    for p in (port, port + BUS_OFFSET):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


def _claim_pair(port: int) -> bool:
    """Both ports in the machine's ledger, so a cluster starting beside this one draws neither."""
    return all(port_ledger.claim("127.0.0.1", p) for p in (port, port + BUS_OFFSET))


def free_ports(count: int) -> list[int]:
    """count ports whose cluster-bus ports (port + 10000) are free too, both within free_port's
    range ($PDSERVE_PORT_RANGE: the test suite's workers draw apart)."""
    lo, hi = port_range()
    if hi - lo < BUS_OFFSET + 256:
        raise RuntimeError(f"ports {lo}-{hi} leave no room for a cluster bus {BUS_OFFSET} above each port")
    ports: list[int] = []
    while len(ports) < count:
        port = random.randrange(lo, hi - BUS_OFFSET)
        if port not in ports and _port_pair_free(port) and _claim_pair(port):
            ports.append(port)
    return ports


def cli(port: int, *args: str, timeout: float = 10) -> str:
    return subprocess.run([REDIS_CLI, "-p", str(port), *args], capture_output=True, text=True,
                          timeout=timeout).stdout


def server_command(port: int, directory: str) -> list[str]:
    """A cluster server's command line: loopback, persistence off, its node file in directory
    (a server restarted with it rejoins as the node it was)."""
    return [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--cluster-enabled", "yes", "--cluster-config-file", f"{directory}/nodes-{port}.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-replica-validity-factor", "0",
            "--dir", directory, "--loglevel", "warning"]


def create_cluster(ports, replicas: int) -> None:
    """redis-cli --cluster create over servers that answer; RuntimeError with its output if it fails."""
    out = subprocess.run([REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                          "--cluster-replicas", str(replicas), "--cluster-yes"],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")


def cluster_ok(port: int, timeout: float = 10) -> bool:
    return "cluster_state:ok" in cli(port, "cluster", "info", timeout=timeout)


def masters_seen_by(port: int, timeout: float = 10) -> list[int]:
    """Ports of the live masters that serve slots, as the server at port sees them now."""
    masters = []
    for line in cli(port, "cluster", "nodes", timeout=timeout).splitlines():
        fields = line.split()
        if "master" in fields[2] and "fail" not in fields[2] and len(fields) > 8:
            masters.append(int(fields[1].split("@")[0].rsplit(":", 1)[1]))
    return sorted(masters)


class RedisCluster:
    def __init__(self, masters: int, replicas: int):
        self.dir = tempfile.mkdtemp(prefix="pdrc-")
        self.procs: dict[int, subprocess.Popen] = {}
        for port in free_ports(masters * (1 + replicas)):
            self._start(port)
        self.replicas = replicas

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.procs)

    def _start(self, port: int) -> None:
        self.procs[port] = subprocess.Popen(server_command(port, self.dir), stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)

    def _wait_started(self, deadline: float) -> None:
        while not all(cli(p, "ping").strip() == "PONG" for p in self.procs):
            for port in [p for p, proc in self.procs.items() if proc.poll() is not None]:
                # Another process took its port (or bus port) after _ports checked it: move on.
                del self.procs[port]
                self._start(next(p for p in free_ports(len(self.procs) + 1) if p not in self.procs))
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server nodes did not start")
            time.sleep(0.05)

    def create(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        self._wait_started(deadline)
        create_cluster(self.procs, self.replicas)
        self.wait_ok(deadline - time.monotonic())

    def wait_ok(self, timeout_s: float = 30) -> None:
        """Every live node reports cluster_state:ok, and every slot has a live master."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = [p for p, proc in self.procs.items() if proc.poll() is None]
            if all(cluster_ok(p) for p in live):
                return
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def masters(self) -> list[int]:
        """Ports of the live masters that serve slots, as a live node sees them now."""
        live = [p for p, proc in self.procs.items() if proc.poll() is None]
        return masters_seen_by(live[0])

    def keys_per_master(self) -> dict[int, int]:
        return {p: int(cli(p, "dbsize").strip() or 0) for p in self.masters()}

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def redis_cluster(masters: int = 3, replicas: int = 1) -> Iterator[RedisCluster]:
    cluster = RedisCluster(masters, replicas)
    try:
        cluster.create()
        yield cluster
    finally:
        cluster.stop()
