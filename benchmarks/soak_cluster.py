"""The soak's cluster: a router and 2 prefill and 2 decode nodes (built-in model), handing KV over
by NIXL or through the store (LMCache tiers over a Redis started here with the command `pdserve
up --kv-transfer store` gives its own), each its own OS process started here, so that any of
them, the router and Redis included, can be killed, stopped and restarted on the same addresses,
as `pdserve up` or a container runtime would. The router runs with a short HTTP keep-alive
(soak_router), so that an idle fault outlasts it. Every node and the router serve the soak's LoRA
adapter; decode-1 speculates (n-gram drafts), decode-0 does not, and runs at TP 2 when asked.

The cluster is the router's node owner too (`--owner`, as `pdserve up`'s launcher is): the
router's /admin/scale starts nodes here and stops the ones it drained, and a role switch is
recorded, so that a node restarts in its new role.

A supervisor thread restarts a process that died (after RESTART_DELAY_S), until stop(). Every
pid ever started is kept, so stop() can say whether any process was left behind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from benchmarks.soak_load import ADAPTER, MODEL
from benchmarks.soak_store import SCHEMES, SoakRedis
from pdserve.cluster.owner import with_role
from pdserve.cluster.owner_admin import OwnerAdminServer
from pdserve.wire.transport import free_port

RESTART_DELAY_S = 0.5
KEEP_ALIVE_S = 6.0  # the router's: longer than the clients' 5 s, as the 75 s default is
TRANSPORTS = ("nixl", *SCHEMES)  # through the store: soak_store.SCHEMES
SPECULATIVE = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, '
               '"prompt_lookup_max": 4}')  # min 1: the random model repeats little, a token often


@dataclass
class Proc:
    name: str
    cmd: list[str]
    popen: subprocess.Popen | None = None
    pids: list[int] = field(default_factory=list)  # every process started under this name
    starts: int = 0
    stopped: bool = False  # SIGSTOPped: not dead, not to be restarted


class SoakCluster:
    def __init__(self, workdir: Path, lease_s: float, adapter: Path, transport: str = "nixl", prefill: int = 2,
                 decode: int = 2, decode_tp: int = 1):
        """adapter: a LoRA adapter of MODEL, served by every node and the router as soak_load.ADAPTER;
        decode_tp: decode-0's tensor-parallel degree (its workers are processes a fault can kill)."""
        self.workdir, self.transport, self.decode_tp = workdir, transport, decode_tp
        lora = ["--lora-modules", f"{ADAPTER}={adapter}"]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, Proc] = {}
        self.redis = SoakRedis(transport, workdir) if transport in SCHEMES else None
        for name, cmd in self.redis.commands().items() if self.redis else ():
            self.procs[name] = Proc(name, cmd)
        self.lease_s, self.lora = lease_s, lora
        self.addresses: dict[str, str] = {}  # node -> its control endpoint
        self.roles: dict[str, str] = {}      # node -> its role now (a switch changes it)
        self.retired: list[Proc] = []        # nodes the owner stopped (scaled down): for _left_behind
        self._started = {"prefill": 0, "decode": 0}
        for role, count in (("prefill", prefill), ("decode", decode)):
            for i in range(count):
                spec = ["--speculative-config", SPECULATIVE] if (role, i) == ("decode", 1) else []
                if (role, i) == ("decode", 0) and decode_tp > 1:
                    spec = ["--tensor-parallel-size", str(decode_tp)]
                self._add_node(role, spec)
        self.owner_address = f"tcp://127.0.0.1:{free_port()}"  # the router's StartNode/StopNode land here
        self._admin: OwnerAdminServer | None = None
        self._add("router", ["router", "--model", MODEL, "--port", str(self.port), "--kv-transfer",
                             "store" if self.redis else transport, *lora, "--owner", self.owner_address,
                             "--local-prefill-threshold", "0", "--prefill-placement", "threshold",
                             *[a for n in self.nodes for a in (f"--{self.roles[n]}", self.addresses[n])]],
                  module="benchmarks.soak_router")
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)

    def _transfer_flags(self, role: str, lease_s: float) -> list[str]:
        """A node's flags for its transport, as `pdserve up` gives them."""
        if self.redis is not None:
            return ["--store", self.redis.url]
        side = ["--nixl-side-channel", f"tcp://127.0.0.1:{free_port()}", "--lease-s", str(lease_s)]
        return side + (["--nixl"] if role == "decode" else [])

    def _add_node(self, role: str, extra: list[str]) -> str:
        name = f"{role}-{self._started[role]}"
        self._started[role] += 1
        self.addresses[name], self.roles[name] = f"tcp://127.0.0.1:{free_port()}", role
        self._add(name, [role, "--model", MODEL, "--node-id", name, "--bind", self.addresses[name],
                         "--num-kv-blocks", "256", *self._transfer_flags(role, self.lease_s), *self.lora, *extra])
        return name

    def _add(self, name: str, args: list[str], module: str = "pdserve") -> None:
        self.procs[name] = Proc(name, [sys.executable, "-m", module, "--log-level", "WARNING", *args])

    @property
    def nodes(self) -> list[str]:
        # (the owner's thread adds and removes them)
        return [n for n in list(self.procs) if n != "router" and not (self.redis and n in self.redis.ports)]

    # ---- NodeOwner (pdserve.cluster.owner): the router's /admin/scale and switches end here --
    def start_node(self, role: str) -> str:
        """A node with the soak's flags (no speculation, TP 1); it joins at its first pong. Like
        `pdserve up`'s nodes, a decode node has a NIXL side channel too."""
        with self._lock:
            name = self._add_node(role, [])
            self._spawn(self.procs[name])
        return name

    def stop_node(self, node_id: str) -> None:
        """SIGTERM a drained node; it is not restarted, and stop() still checks it is gone."""
        with self._lock:
            proc = self.procs.pop(node_id)
            del self.addresses[node_id], self.roles[node_id]
            self.retired.append(proc)
        proc.popen.send_signal(signal.SIGCONT)
        proc.popen.terminate()
        try:
            proc.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait()

    def set_role(self, node_id: str, role: str) -> None:
        """The node switched in place: a restart after it dies starts it in its new role."""
        with self._lock:
            self.procs[node_id].cmd = with_role(self.procs[node_id].cmd, role)
            self.roles[node_id] = role

    def owned_nodes(self) -> dict[str, str]:
        with self._lock:
            return dict(self.roles)

    def _spawn(self, proc: Proc) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
               "PDSERVE_SOAK_KEEP_ALIVE_S": str(KEEP_ALIVE_S)}
        log = open(self.workdir / f"{proc.name}.log", "a")
        proc.popen = subprocess.Popen(proc.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
        log.close()
        proc.pids.append(proc.popen.pid)
        proc.starts += 1

    def launch(self) -> None:
        """Start every process and the supervisor; wait_healthy() says when they serve."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._admin = OwnerAdminServer(self, self.owner_address, self.addresses.__getitem__).start()
        servers = [self.procs[name] for name in self.redis.ports] if self.redis else []
        for proc in servers:  # Redis first: a Redis Cluster is formed before any node connects
            self._spawn(proc)
        if self.redis is not None:
            self.redis.form()
        for proc in self.procs.values():
            if proc not in servers:
                self._spawn(proc)
        self._supervisor.start()

    def _supervise(self) -> None:
        while not self._stopping.wait(0.2):
            with self._lock:
                dead = [p for p in self.procs.values() if p.popen is not None and p.popen.poll() is not None]
            for proc in dead:
                time.sleep(RESTART_DELAY_S)
                with self._lock:
                    if not self._stopping.is_set() and self.procs.get(proc.name) is proc:  # not scaled away
                        self._spawn(proc)

    def signal(self, name: str, sig: int) -> None:
        proc = self.procs[name]
        with self._lock:
            if proc.popen is not None and proc.popen.poll() is None:
                proc.popen.send_signal(sig)
                proc.stopped = sig == signal.SIGSTOP

    def kill_worker(self, name: str) -> bool:
        """SIGKILL a TP worker of node `name`: the node goes down with it, and the supervisor
        restarts the node. False when the node has no worker running."""
        with self._lock:
            proc = self.procs[name]
            try:
                workers = psutil.Process(proc.popen.pid).children() if proc.popen.poll() is None else []
            except psutil.Error:
                workers = []
        if not workers:
            return False
        workers[0].send_signal(signal.SIGKILL)
        return True

    def health(self) -> dict | None:
        try:
            resp = httpx.get(f"{self.url}/health", timeout=3)
            return resp.json() if resp.status_code in (200, 503) else None
        except (httpx.HTTPError, ValueError):
            return None

    def redis_up(self) -> bool:
        return self.redis is None or self.redis.up()

    def all_healthy(self) -> bool:
        body = self.health()
        nodes_up = bool(body) and len(body["nodes"]) == len(self.nodes) and all(n["healthy"] for n in body["nodes"])
        return nodes_up and self.redis_up()

    def wait_healthy(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.all_healthy():
                return True
            time.sleep(0.5)
        return False

    def rss(self) -> dict[str, int]:
        out = {}
        for name, proc in list(self.procs.items()):
            try:
                out[name] = psutil.Process(proc.popen.pid).memory_info().rss
            except (psutil.Error, AttributeError):
                pass
        return out

    def stop(self) -> list[str]:
        """Stop every process; returns those still alive afterwards (with their children)."""
        self._stopping.set()
        if self._supervisor.is_alive():
            self._supervisor.join(timeout=5)
        if self._admin is not None:
            self._admin.stop()
            self._admin = None
        for proc in self.procs.values():
            if proc.popen is not None and proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGCONT)
                proc.popen.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            if proc.popen is None:
                continue
            try:
                proc.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait()
        time.sleep(0.5)
        return self._left_behind()

    def _left_behind(self) -> list[str]:
        """Processes of any group started here (each process led its own): TP workers included."""
        groups = {pid: proc.name for proc in [*self.procs.values(), *self.retired] for pid in proc.pids}
        left = []
        for p in psutil.process_iter():
            try:
                group = os.getpgid(p.pid)
                if group in groups and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{groups[group]}: pid {p.pid}")
            except (psutil.Error, ProcessLookupError):
                continue
        return left
