"""The cluster's owner on Ray: one actor, on the head machine, that starts and stops node and
router actors and hosts the node registry (pdserve.cluster.registry) and the owner's admin server
on the head's Ray node address (never an address guessed from the machine's interfaces).

It implements NodeOwner (pdserve.cluster.owner): scaling, restarts and role switches go through
it. Each node and router is a ProcessActor of its own, placed with the resources the launch
asked for (CPU threads, GPUs, an optional custom resource per role) and spread over the
machines; a tensor-parallel node runs in a STRICT_PACK placement group of its own, one bundle
per rank (pdserve.cluster.ray_placement); Ray restarts one whose process or machine died (max_restarts), and the new process
registers its new address, so routers follow without a restart.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from pdserve.cluster.owner_admin import OwnerAdminServer
from pdserve.cluster.ray_actors import ProcessActor, node_address
from pdserve.cluster.ray_placement import actor_options_in_group, create_node_group, rank_bundles, remove_node_group
from pdserve.cluster.ray_routers import RayRouters
from pdserve.cluster.registry import RegistryServer
from pdserve.cluster.registry_messages import AdminReply, ScaleRequest, SwitchRequest
from pdserve.wire.messages import ROLES

log = logging.getLogger(__name__)
# Roles a node starts in: the KV roles (a node may switch between them) and encoder nodes (E/P/D).
NODE_ROLES = (*ROLES, "encode")


@dataclass
class Placement:
    """How each process is placed (all from `pdserve up --ray` flags)."""
    threads_per_node: int = 1
    gpus_per_node: float = 0.0
    role_resources: dict[str, str] = field(default_factory=dict)  # role -> custom resource name
    max_restarts: int = 20
    spread: bool = True
    router_env: dict[str, str] = field(default_factory=dict)  # extra environment of router processes
    # role -> tensor-parallel size. A TP node's workers are child processes of its node process,
    # so they run on the node's machine; a STRICT_PACK placement group, one bundle per rank,
    # reserves their CPUs (and GPUs) there before the node starts (see ray_placement).
    role_tp: dict[str, int] = field(default_factory=dict)


class RayController:
    """Use through ray.remote (pdserve.entrypoints.ray_launch does)."""

    def __init__(self, templates: dict[str, list[str]], placement: Placement):
        self.templates = templates  # role or "router" -> pdserve arguments with placeholders
        self.placement = placement
        self.ip = node_address()
        self.registry = RegistryServer(f"tcp://{self.ip}:0", on_admin=self.on_admin).start()
        self.nodes: dict[str, tuple[str, object]] = {}  # node_id -> (role, actor handle)
        self.groups: dict[str, object] = {}  # node_id -> its placement group (TP nodes only)
        self.routers: RayRouters | None = None
        self._next_index = dict.fromkeys(NODE_ROLES, 0)
        self._lock = threading.RLock()  # admin requests arrive on other threads
        # node_id -> the role it switched to, in Ray's key-value store: read by a restarted actor.
        self.roles_namespace = f"pdserve-roles-{uuid.uuid4().hex}"
        # The routers' StartNode/StopNode (pdserve scale, /admin/scale) arrive here (--owner).
        self.admin = OwnerAdminServer(self, f"tcp://{self.ip}:0", self.control_address).start()

    def registry_address(self) -> str:
        return self.registry.address

    def control_address(self, node_id: str, timeout_s: float = 120.0) -> str:
        """Where a node's control socket is (waits for its actor to have started its process)."""
        import ray  # optional dependency: ray (the pdserve[ray] extra)
        with self._lock:
            actor = self.nodes[node_id][1]
        info = ray.get(actor.info.remote(), timeout=timeout_s)
        return f"tcp://{info['ip']}:{info['ports']['control']}"

    # ---- NodeOwner --------------------------------------------------------------------------
    def start_node(self, role: str) -> str:
        if role not in NODE_ROLES:
            raise ValueError(f"unknown role {role!r}")
        with self._lock:
            node_id = f"{role}-{self._next_index[role]}"
            self._next_index[role] += 1
        template = [arg.replace("{node_id}", node_id) for arg in self.templates[role]]
        template += ["--registry", self.registry.address]
        p = self.placement
        resources = {p.role_resources[role]: 1} if p.role_resources.get(role) else None
        tp = p.role_tp.get(role, 1)
        in_group = self._node_group(node_id, role) if tp > 1 else None
        # The node's process gets every rank's threads; its executor divides them among the ranks.
        actor = self._actor(node_id, template, p.threads_per_node * tp, p.gpus_per_node * tp, resources,
                            roles_namespace=self.roles_namespace, in_group=in_group)
        with self._lock:
            self.nodes[node_id] = (role, actor)
        log.info("started %s", node_id)
        return node_id

    def _node_group(self, node_id: str, role: str) -> dict:
        """A TP node's placement group (reserved before its actor starts), and the actor options
        that run the node in its bundle 0."""
        p = self.placement
        bundles = rank_bundles(p.role_tp[role], p.threads_per_node, p.gpus_per_node, p.role_resources.get(role))
        group = create_node_group(f"{self.roles_namespace}-{node_id}", bundles)
        with self._lock:
            self.groups[node_id] = group
        return actor_options_in_group(group, bundles[0])

    def _release_group(self, node_id: str) -> None:
        with self._lock:
            group = self.groups.pop(node_id, None)
        if group is not None:
            remove_node_group(group)

    def stop_node(self, node_id: str) -> None:
        with self._lock:
            role_actor = self.nodes.pop(node_id, None)
        if role_actor is None:
            raise ValueError(f"no node {node_id!r}")
        self._stop_actor(role_actor[1])
        self._release_group(node_id)
        self._forget_role(node_id)

    def set_role(self, node_id: str, role: str) -> None:
        from ray.experimental.internal_kv import _internal_kv_put  # optional dependency: ray (the pdserve[ray] extra)
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        with self._lock:
            if node_id not in self.nodes:
                raise ValueError(f"no node {node_id!r}")
            self.nodes[node_id] = (role, self.nodes[node_id][1])
        _internal_kv_put(node_id, role, namespace=self.roles_namespace)

    def _forget_role(self, node_id: str) -> None:
        from ray.experimental.internal_kv import _internal_kv_del  # optional dependency: ray (the pdserve[ray] extra)
        _internal_kv_del(node_id, namespace=self.roles_namespace)

    def owned_nodes(self) -> dict[str, str]:
        with self._lock:
            return {node_id: role for node_id, (role, _) in self.nodes.items()}

    # ---- routers ----------------------------------------------------------------------------
    def start_routers(self, count: int, port: int) -> list[str]:
        """`count` routers spread over the machines, router i on port + i; returns their URLs."""
        template = self.templates["router"] + ["--registry", self.registry.address, "--owner", self.admin.address]
        self.routers = RayRouters(self._router_actor, template, port)
        return self.routers.start(count)

    def _router_actor(self, name: str, template: list[str], strategy):
        return self._actor(name, template, 1, 0.0, None, num_cpus=0, strategy=strategy, env=self.placement.router_env)

    # ---- state for the launcher and tests ---------------------------------------------------
    def members(self) -> list[dict]:
        return [{"node_id": r.node_id, "role": r.role, "control_addr": r.control_addr, "state": r.state,
                 "incarnation": r.incarnation} for r in self.registry.members()]

    def processes(self) -> dict[str, dict]:
        """name -> where its process runs now (ip, pid, actor pid), for every live actor."""
        import ray  # optional dependency: ray (the pdserve[ray] extra)
        with self._lock:
            handles = {node_id: actor for node_id, (_, actor) in self.nodes.items()}
        handles |= {f"router-{i}": actor for i, actor in enumerate(self.routers.actors if self.routers else [])}
        out = {}
        for name, actor in handles.items():
            try:
                out[name] = ray.get(actor.info.remote(), timeout=10)
            except Exception as exc:  # restarting, or its machine is gone: the caller asks again
                out[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        return out

    def ping(self) -> float:
        return time.time()

    def shutdown(self) -> None:
        """Stop every process this controller started (routers first, so no new requests; the
        nodes side by side)."""
        if self.routers is not None:
            self.routers.stop(self._stop_actors)
        self._stop_actors([actor for _, actor in self.nodes.values()])
        for node_id in self.nodes:
            self._release_group(node_id)
            self._forget_role(node_id)
        self.routers, self.nodes = None, {}
        self.admin.stop()
        self.registry.stop()

    # ---- admin requests through the registry ----------------------------------------------
    def on_admin(self, msg: ScaleRequest | SwitchRequest) -> AdminReply:
        if isinstance(msg, SwitchRequest):
            return AdminReply(False, "role switches are requested from a router (it drains the node first)")
        changes = []
        for role, want in (("prefill", msg.prefill), ("decode", msg.decode)):
            have = sorted(n for n, r in self.owned_nodes().items() if r == role)
            while want is not None and len(have) < want:
                have.append(self.start_node(role))
                changes.append(f"+{have[-1]}")
            while want is not None and len(have) > want:  # newest first; routers drain before this
                node_id = have.pop()
                self.stop_node(node_id)
                changes.append(f"-{node_id}")
        return AdminReply(True, " ".join(changes) or "no change")

    # ---- actors -----------------------------------------------------------------------------
    def _actor(self, name: str, template: list[str], threads: int, gpus: float, resources: dict | None,
               num_cpus: float | None = None, strategy=None, env: dict[str, str] | None = None,
               roles_namespace: str | None = None, in_group: dict | None = None):
        """in_group: options that place the actor in its placement group's bundle (resources
        and strategy), instead of the ones reserved here."""
        import ray  # optional dependency: ray (the pdserve[ray] extra)
        options = dict(num_cpus=threads if num_cpus is None else num_cpus, num_gpus=gpus,
                       max_restarts=self.placement.max_restarts, name=None, lifetime=None)
        if resources:
            options["resources"] = resources
        if strategy is not None or self.placement.spread:
            options["scheduling_strategy"] = strategy or "SPREAD"
        if in_group:
            options.pop("resources", None)
            options |= in_group
        return ray.remote(ProcessActor).options(**options).remote(name, template, threads, env=env,
                                                                  roles_namespace=roles_namespace)

    def _stop_actor(self, actor) -> None:
        self._stop_actors([actor])

    @staticmethod
    def _stop_actors(actors: list) -> None:
        import ray  # optional dependency: ray (the pdserve[ray] extra)
        for actor, stopping in [(a, a.stop.remote()) for a in actors]:
            try:
                ray.get(stopping, timeout=30)
            except Exception as exc:  # already gone: nothing left to stop gracefully
                log.info("stopping an actor: %s", exc)
            ray.kill(actor, no_restart=True)
