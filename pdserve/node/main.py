"""`pdserve prefill`, `pdserve decode` and `pdserve encode`: build the engine, the store and NIXL, then serve."""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import NoReturn

from pdserve.engine.config import EngineConfig, engine_options
from pdserve.kvstore.redact import embedding_store_url
from pdserve.kvstore.ucx_devices import pin_ucx_to_host
from pdserve.node.compute_thread import on_compute_thread
from pdserve.node.core_board import BOARD_ENV, machine_cores
from pdserve.wire.curve_keys import NodeKeys

log = logging.getLogger(__name__)


def node_thread_share(env: dict[str, str] | None = None) -> int | None:
    """Compute threads this node may use, or None to keep the libraries' defaults.

    PDSERVE_THREADS_PER_NODE wins; else PDSERVE_NODES_PER_HOST divides the cores (containers
    see every core of the host, and four nodes each sizing their pools to all of them
    oversubscribe it); else OMP_NUM_THREADS, which `pdserve up` sets per node.
    """
    env = os.environ if env is None else env
    explicit = env.get("PDSERVE_THREADS_PER_NODE", "")
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit)
    nodes = env.get("PDSERVE_NODES_PER_HOST", "")
    if nodes.isdigit() and int(nodes) > 0:
        return max(1, machine_cores() // int(nodes))
    omp = env.get("OMP_NUM_THREADS", "")
    return int(omp) if omp.isdigit() and int(omp) > 0 else None


def _apply_thread_limit() -> None:
    """torch reads OMP_NUM_THREADS at import on most builds; set it explicitly to be sure.

    numba reads NUMBA_NUM_THREADS when it is first imported, which is after this point.
    """
    threads = node_thread_share()
    if threads is None:
        return
    # With cores lent (pdserve.node.core_board), numba's pool is sized to the machine and each
    # step uses what the board allows; torch's grows and shrinks on request.
    numba_threads = max(threads, machine_cores()) if os.environ.get(BOARD_ENV) else threads
    os.environ.update(OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(numba_threads))
    import torch  # deferred: this module is torch-free until a node is served
    torch.set_num_threads(threads)
    log.info("compute threads for this node: %d", threads)


def _engine(args, role: str):
    _apply_thread_limit()
    if getattr(args, "tensor_parallel_size", 1) > 1 or getattr(args, "pipeline_parallel_size", 1) > 1:
        from pdserve.executor import executor  # deferred: loads torch; torch-free until a node is served
        executor.EXIT_ON_WORKER_DEATH = True  # a lost worker takes the node down; its owner restarts it
    from pdserve.assembly.build import build_engine  # deferred: loads torch; torch-free until a node is served
    return build_engine(EngineConfig(model=args.model, remote_kv_timeout_s=args.kv_timeout_s, **engine_options(args)),
                        role=role)


def _use_curve(args) -> None:
    """Before the engine loads: a bad key directory fails in a second, not after the weights."""
    from pdserve.node.runtime import NodeRuntime  # deferred: loads torch; torch-free until a node is served
    NodeRuntime.curve = NodeKeys.load(args.curve_dir) if args.curve_dir else None
    NodeRuntime.registry = getattr(args, "registry", None)
    NodeRuntime.advertise_host = getattr(args, "advertise_host", None)
    if (url := embedding_store_url(getattr(args, "store", None))) is not None:
        # deferred: torch and redis-py, which a node without a store never imports (0.1 s of CPU)
        from pdserve.kvstore.embedding_store import EmbeddingStore
        NodeRuntime.embedding_store = EmbeddingStore(url)  # image embeddings from encoder nodes


def _pin_ucx(bind: str) -> None:
    """NIXL's UCX listens only where the node's control socket is bound (not on every interface)."""
    host = bind.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if (device := pin_ucx_to_host(host)) is not None:
        log.info("UCX limited to network device %s (the one holding %s)", device, host)


def _store(args, engine):
    if not args.store:
        return None
    from pdserve.kvstore.factory import make_store  # deferred: redis-py, which a node without a store never imports
    from pdserve.kvstore.layout import KVLayout  # deferred: loads torch; torch-free until a node is served
    options = {"chunk_tokens": args.store_chunk_tokens, "lmcache_config": args.lmcache_config}
    return make_store(args.store, layout=KVLayout.from_cache(engine.kv_cache, args.model),
                      **{k: v for k, v in options.items() if v is not None})


def _build_node(role: str, args, engine, bind, store):
    """A node of `role`. bind is an endpoint, or the node this one takes over from (role switch).

    Either role's transfer options come from the same flags: a prefill node with a NIXL side
    channel pulls over NIXL once it decodes; a decode node given --nixl-side-channel serves NIXL
    READs once it prefills."""
    nixl_side_channel = getattr(args, "nixl_side_channel", None)
    if role == "encode":
        from pdserve.node.encode import EncodeNode  # heavy: torch and the engine, for node processes only
        return EncodeNode(engine, bind, args.node_id, nixl_side_channel=nixl_side_channel,
                          lease_s=getattr(args, "lease_s", 30.0), advertise_host=getattr(args, "advertise_host", None))
    if role == "prefill":
        from pdserve.node.prefill import PrefillNode  # heavy: torch and the engine, for node processes only
        return PrefillNode(engine, bind, args.node_id, store=store, nixl_side_channel=nixl_side_channel,
                           lease_s=getattr(args, "lease_s", 30.0), advertise_host=getattr(args, "advertise_host", None),
                           layer_groups=getattr(args, "push_layer_groups", 0))
    from pdserve.node.decode import DecodeNode  # heavy: torch and the engine, for node processes only
    return DecodeNode(engine, bind, args.node_id, store=store,
                      use_nixl=getattr(args, "nixl", False) or bool(nixl_side_channel),
                      on_transfer_failure=getattr(args, "on_transfer_failure", "recompute"),
                      pull_delay_s=getattr(args, "pull_delay_s", 0.0),
                      prefetch_stored_prefix=getattr(args, "prefetch_stored_prefix", False))


def serve_node(role: str, args) -> NoReturn:
    """Serve as `role`; a drained role switch builds the other role's node over the same engine,
    store client and control socket, without reloading weights."""
    _use_curve(args)
    _pin_ucx(args.bind)
    engine = on_compute_thread(_engine, args, role)  # one OpenMP pool: see node.compute_thread
    store = _store(args, engine)
    node = _build_node(role, args, engine, args.bind, store)
    node.step_delay_s = getattr(args, "step_delay_ms", 0.0) / 1000
    _load_full_tokenizer_beside(engine)
    while (to_role := node.serve_forever()) is not None:
        started = time.perf_counter()
        node = _build_node(to_role, args, engine, node, store)
        log.info("%s is a %s node now (%.3f s to switch)", args.node_id, to_role, time.perf_counter() - started)
    engine.close()  # a TP or PP node's workers stop now, not at the interpreter's exit
    _exit_now(0)


def _load_full_tokenizer_beside(engine) -> None:
    """A node decodes with its tokenizer's snapshot (pdserve.models.tokenizer_snapshot), which
    keeps transformers off its start; a structured-output request needs transformers' class, and
    loading it inside the first one took 0.75 s of CPU on the loop thread that answers the routers'
    pings (a node silent for 1.5 s is taken for dead). It loads on a thread of its own once the
    node serves, as the first requests arrive."""
    full = getattr(engine.tokenizer, "full", None)
    if full is not None:
        threading.Thread(target=full, name="full-tokenizer", daemon=True).start()


def _exit_now(code: int) -> NoReturn:
    """End a stopped node without the interpreter's teardown. With torch and the model loaded,
    collecting every module's objects at exit took 2-5 s on 2 cores, and `pdserve up` kills what
    has not exited 10 s after its SIGTERM. The node has closed its sockets, transfer agents and
    store by now; atexit's handlers still run, and the logs are flushed."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

