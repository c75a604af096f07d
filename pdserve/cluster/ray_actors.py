"""One pdserve process (a prefill node, a decode node or a router) inside a Ray actor.

The actor runs on whatever machine Ray placed it. It binds every socket of its process to that
machine's own address (the address its raylet registered, which `ray start --node-ip-address`
sets; see node_address), on ports it picks there, and advertises that address, so routers, NIXL
peers and the store reach it from other machines. The process is a child of the actor, started with the command line `pdserve up`
would use, so a node behaves on Ray exactly as it does locally.

Fate is shared both ways: the child gets SIGTERM when the actor's process dies (PR_SET_PDEATHSIG),
and the actor exits when the child dies unexpectedly, so Ray restarts the actor (max_restarts),
on another machine if this one is gone, and the new process registers its new address.

Ray carries only placement and restarts: tokens and KV never pass through actor calls.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading

from pdserve.cluster.owner import with_role
from pdserve.wire.transport import free_port

log = logging.getLogger(__name__)
STOP_GRACE_S = 10.0


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def node_address() -> str:
    """The address this worker's raylet registered in Ray's node table (`ray start
    --node-ip-address`), never one guessed from the machine's interfaces: a machine can hold
    several (a bridge, a container network, network namespaces), and only this one is the Ray
    node's."""
    import ray  # optional dependency: ray (the pdserve[ray] extra)
    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == here:
            return node["NodeManagerAddress"]
    raise RuntimeError(f"this worker's node {here} is not in Ray's node table")


def fill_template(template: list[str], ip: str, ports: dict[str, int]) -> list[str]:
    """Replace "{ip}" and "{port:NAME}" inside each argument (a port per NAME, picked here)."""
    out = []
    for arg in template:
        arg = arg.replace("{ip}", ip)
        for name, port in ports.items():
            arg = arg.replace(f"{{port:{name}}}", str(port))
        out.append(arg)
    return out


def template_ports(template: list[str]) -> list[str]:
    names = []
    for arg in template:
        start = arg.find("{port:")
        while start >= 0:
            end = arg.index("}", start)
            names.append(arg[start + 6:end])
            start = arg.find("{port:", end)
    return sorted(set(names))


def switched_role(template: list[str], roles_namespace: str | None, name: str) -> list[str]:
    """The node's template in the role it last switched to, if it did: the controller keeps
    that in Ray's key-value store, which a restarted actor reads on any machine."""
    if not roles_namespace:
        return template
    from ray.experimental.internal_kv import _internal_kv_get  # optional dependency: ray (the pdserve[ray] extra)
    role = _internal_kv_get(name, namespace=roles_namespace)
    return with_role(template, role.decode()) if role else template


class ProcessActor:
    """Runs `python -m pdserve ARGS` on this actor's machine until stop() (use with ray.remote).
    roles_namespace: where a node finds the role it switched to (see switched_role)."""

    def __init__(self, name: str, template: list[str], threads: int | None = None,
                 fixed_ports: dict[str, int] | None = None, env: dict[str, str] | None = None,
                 roles_namespace: str | None = None):
        self.name = name
        self.ip = node_address()
        template = switched_role(template, roles_namespace, name)
        ports = {p: free_port(self.ip) for p in template_ports(template)} | (fixed_ports or {})
        self.argv = [sys.executable, "-m", "pdserve", *fill_template(template, self.ip, ports)]
        self.ports = ports
        self.env = dict(os.environ) | (env or {})
        if threads:
            self.env.update(OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads))
        self.proc: subprocess.Popen | None = None
        self._stopping = False
        self._spawned = threading.Event()
        # The child is started from the thread that waits on it: PR_SET_PDEATHSIG fires when the
        # thread that forked it exits, so that thread must live exactly as long as the child.
        threading.Thread(target=self._run, name=f"{name}-child", daemon=True).start()
        self._spawned.wait()

    def _run(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, preexec_fn=_die_with_parent)
        self._spawned.set()
        code = self.proc.wait()
        if not self._stopping:
            # Exit the actor's process: Ray restarts the actor, and with it the node.
            print(f"pdserve: {self.name} exited with code {code}: restarting its actor", file=sys.stderr, flush=True)
            os._exit(1)

    def info(self) -> dict:
        return {"name": self.name, "ip": self.ip, "pid": self.proc.pid if self.proc else None,
                "actor_pid": os.getpid(), "ports": self.ports}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM the process (a node deregisters and closes), SIGKILL it after STOP_GRACE_S."""
        self._stopping = True
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
