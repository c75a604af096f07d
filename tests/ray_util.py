"""Machines on this one for Ray tests: network namespaces on a bridge (as tests/test_multihost.py
builds them), a Ray head and workers each started with `ray start` inside its own namespace with
its own address, and a clean-up that stops exactly the processes living in those namespaces.

Every Ray process (GCS, raylets, workers, agents) and every pdserve process the tests start runs
inside one of these namespaces, so Ray's wildcard binds only ever reach the namespaces' own
addresses, and stopping a "machine" means signalling the pids `ip netns pids` lists for it.
`ray stop` is never used: it ends every Ray process on the machine.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
TAG = f"{os.getpid() % 10000:04d}"
# The lab's machines share one kernel, so UCX would reach across their namespaces by shared
# memory and cross-memory attach, which separate machines cannot, and which left about half the
# runs' NIXL READs between namespaces unanswered until their deadline (the decode node then
# recomputed, 30 s a request). TCP, as docs/deployment-hosts.md sets for hosts without RDMA.
LAB_UCX_TLS = os.environ.get("LAB_UCX_TLS", "tcp,self")
# LAB_UCX_TLS (empty: UCX's own choice) and LAB_KEEP=1 (the lab's Ray logs kept, their folder
# printed as LAB_TMP) are for chasing that stall (docs/testing.md); CI sets neither.
SUBNET = f"10.{150 + os.getpid() % 50}.{os.getpid() % 250}"
# Fast failure detection for the head's GCS: a lost machine's actors restart within seconds.
HEAD_SYSTEM_CONFIG = '{"health_check_period_ms":500,"health_check_failure_threshold":4,"health_check_timeout_ms":1000}'


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    probe = f"rayprobe{TAG}"
    if _run("ip", "netns", "add", probe, check=False).returncode != 0:
        return "cannot create a network namespace here (ip netns add failed)"
    _run("ip", "netns", "del", probe, check=False)
    return None


class Lab:
    """Hosts by short name, each a namespace with address SUBNET.N on one bridge (root at .1)."""

    def __init__(self, hosts: dict[str, int]):
        self.hosts = hosts
        self.bridge = f"rbr{TAG}"
        self.tmp = tempfile.mkdtemp(prefix="pr", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes

    def ns(self, name: str) -> str:
        return f"ray{name}{TAG}"

    def addr(self, name: str) -> str:
        return f"{SUBNET}.{self.hosts[name]}"

    def addresses(self) -> set[str]:
        """The hosts' own addresses (not the bridge's, which sits in the root namespace)."""
        return {self.addr(name) for name in self.hosts}

    def temp_dir(self, name: str) -> str:
        return f"{self.tmp}/{name}"

    def up(self) -> None:
        self.down()  # leftovers of a lab torn down uncleanly
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{SUBNET}.1/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        _run("iptables", "-I", "FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT", check=False) \
            if shutil.which("iptables") else None
        for name in self.hosts:
            host_end, ns_end = f"rv{name}{TAG}", f"rp{name}{TAG}"
            _run("ip", "netns", "add", self.ns(name))
            _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            _run("ip", "link", "set", ns_end, "netns", self.ns(name))
            _run("ip", "-n", self.ns(name), "addr", "add", f"{self.addr(name)}/24", "dev", ns_end)
            _run("ip", "-n", self.ns(name), "link", "set", ns_end, "up")
            _run("ip", "-n", self.ns(name), "link", "set", "lo", "up")
            _run("ip", "link", "set", host_end, "master", self.bridge)
            _run("ip", "link", "set", host_end, "up")

    def pids(self, name: str) -> list[int]:
        out = _run("ip", "netns", "pids", self.ns(name), check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def kill_host(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Signal every process on host `name` (a machine lost: raylet, workers, nodes)."""
        pids = self.pids(name)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return len(pids)

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every process in the lab's namespaces, SIGKILL what is left after grace_s."""
        for name in self.hosts:
            self.kill_host(name, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(self.pids(n) for n in self.hosts):
            time.sleep(0.2)
        for name in self.hosts:
            self.kill_host(name, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(self.pids(n) for n in self.hosts):
            time.sleep(0.2)

    def down(self) -> None:
        for name in self.hosts:
            _run("ip", "link", "del", f"rv{name}{TAG}", check=False)
            _run("ip", "netns", "del", self.ns(name), check=False)
        if shutil.which("iptables"):
            _run("iptables", "-D", "FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT", check=False)
        _run("ip", "link", "del", self.bridge, check=False)

    def popen(self, name: str, cmd: list[str], log_path: str, env: dict | None = None) -> subprocess.Popen:
        with open(log_path, "a") as log:
            return subprocess.Popen(["ip", "netns", "exec", self.ns(name), *cmd], stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def ray_start(self, name: str, head: str | None, num_cpus: int, port: int = 6379) -> subprocess.Popen:
        """`ray start` on host `name`: the head when head is None, else a worker joining it (wait
        for it with ray_started)."""
        cmd = [RAY, "start", "--node-ip-address", self.addr(name), "--num-cpus", str(num_cpus),
               "--disable-usage-stats", "--temp-dir", self.temp_dir(name)]
        if head is None:
            cmd += ["--head", "--port", str(port), "--include-dashboard=false",
                    f"--system-config={HEAD_SYSTEM_CONFIG}"]
        else:
            cmd += ["--address", f"{self.addr(head)}:{port}"]
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", UCX_TLS=LAB_UCX_TLS)
        if not LAB_UCX_TLS:
            env.pop("UCX_TLS")
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(name), *cmd], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)
        proc.host = name
        return proc

    @staticmethod
    def ray_started(proc: subprocess.Popen) -> None:
        out, _ = proc.communicate(timeout=180)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start on {proc.host} failed:\n{out[-3000:]}")


def machine_addresses() -> set[str]:
    """The machine's own interface addresses, as `hostname -I` lists them (root namespace)."""
    return set(_run("hostname", "-I").stdout.split())


def net_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:  # gone, or a kernel thread
        return None


def _proc_net_address(hex_address: str, family: int) -> str:
    raw = bytes.fromhex(hex_address)
    # /proc/net/tcp* prints each 32-bit word of the address in host (little-endian) order.
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, raw)


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN that process `pid` holds, read in its own
    network namespace (/proc/PID/net), which psutil.net_connections does not see from the root
    namespace. Empty if the process is gone."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile
                if (link := os.readlink(f"/proc/{pid}/fd/{fd}")).startswith("socket:["):
                    inodes.add(link[8:-1])
        tables = [(open(f"/proc/{pid}/net/{name}").read(), family)
                  for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6))]
    except OSError:
        return []
    out = []
    for table, family in tables:
        for line in table.splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                address, port = fields[1].split(":")
                out.append((_proc_net_address(address, family), int(port, 16)))
    return out


@contextlib.contextmanager
def ray_cluster(hosts: dict[str, int], cpus: dict[str, int], head: str = "head"):
    """A lab with Ray running on every host; everything stopped and removed afterwards."""
    lab = Lab(hosts)
    lab.up()
    try:
        lab.ray_started(lab.ray_start(head, None, cpus[head]))
        for worker in [lab.ray_start(name, head, cpus[name]) for name in hosts if name != head]:
            lab.ray_started(worker)  # the workers join side by side
        yield lab
    finally:
        lab.stop_all()
        lab.down()
        if os.environ.get("LAB_KEEP"):
            print("LAB_TMP", lab.tmp)
        else:
            shutil.rmtree(lab.tmp, ignore_errors=True)
