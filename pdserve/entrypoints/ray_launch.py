"""`pdserve up --ray ADDRESS|auto`: the whole cluster on an existing Ray cluster.

This process is Ray's driver. It starts the controller actor (the cluster's NodeOwner and node
registry) on the head machine, asks it for the prefill, decode and encoder nodes and the routers, waits until
every router sees every node healthy, and then watches the controller until it is stopped; then
the controller stops every actor it started. Node and router command lines are the ones `pdserve
up` uses, with each process's address and ports filled in on the machine Ray placed it on.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
import urllib.request

from pdserve.cluster.planner import placement_flags
from pdserve.cluster.ray_controller import Placement, RayController
from pdserve.engine.config import lora_flags
from pdserve.entrypoints.http_flags import http_flags
from pdserve.entrypoints.node_speculation import pool_speculative_config
from pdserve.entrypoints.tp_degrees import pool_degree

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 300
LOOPBACK = ("127.0.0.1", "localhost")
# Ray's own marker resource of the head node (Ray's state actors are placed with it too).
ON_HEAD = {"node:__internal_head__": 0.001}


def node_templates(args, cluster) -> dict[str, list[str]]:
    """pdserve arguments per role, with {node_id}, {ip} and {port:NAME} left for the actor.

    `cluster` is the local launcher's Cluster: its node_cmd gives the same engine flags `pdserve
    up` forwards. Every node gets both roles' transfer flags, so it can switch roles in place."""
    store = args.store
    if args.kv_transfer == "store" and not (store and store.partition("://")[2]):
        raise ValueError("--ray with --kv-transfer store needs --store redis://HOST:PORT (or redis-cluster://...) "
                         "that every machine reaches")
    if args.curve:
        raise ValueError("--curve makes its keys in a local directory; on Ray give every machine the same "
                         "`pdserve keys` directory and start nodes by hand, or run without --curve")
    common = ["--lease-s", str(args.lease_s), "--push-layer-groups", str(args.push_layer_groups),
              "--advertise-host", "{ip}"] + cluster._store_flags(store)
    if args.kv_transfer == "nixl":
        common += ["--nixl-side-channel", "tcp://{ip}:{port:side}"]
    decode = ["--on-transfer-failure", args.on_transfer_failure] + (["--nixl"] if args.kv_transfer == "nixl" else [])
    decode += ["--prefetch-stored-prefix"] if getattr(args, "prefetch_stored_prefix", False) else []
    spec = pool_speculative_config(getattr(args, "speculative_config", None))
    decode += ["--speculative-config", spec] if spec else []
    templates = {role: cluster.node_cmd(role, "{node_id}", "tcp://{ip}:{port:control}",
                                        common + extra + _parallel_flags(args, role))[3:]
                 for role, extra in (("prefill", []), ("decode", decode))}
    if getattr(args, "encode_nodes", 0):
        templates["encode"] = encode_template(args, cluster)
    templates["router"] = router_template(args)
    return templates


def encode_template(args, cluster) -> list[str]:
    """An encoder node's arguments: its embeddings go as the KV goes (NIXL from its own side
    channel, or the store every machine reaches), with a token KV cache (it runs the tower only)."""
    path = (["--nixl-side-channel", "tcp://{ip}:{port:side}", "--lease-s", str(args.lease_s)]
            if args.kv_transfer == "nixl" else cluster._store_flags(args.store))
    extra = ["--advertise-host", "{ip}", *path, "--num-kv-blocks", "16"]
    return cluster.node_cmd("encode", "{node_id}", "tcp://{ip}:{port:control}", extra)[3:]


def _parallel_flags(args, role: str) -> list[str]:
    """The pool's one TP and one PP degree as node flags."""
    tp, pp = pool_degree(args, role), pool_degree(args, role, "pp")
    return ((["--tensor-parallel-size", str(tp)] if tp > 1 else [])
            + (["--pipeline-parallel-size", str(pp)] if pp > 1 else []))


def router_template(args) -> list[str]:
    host = "{ip}" if args.host in LOOPBACK else args.host  # a router is reached from other machines
    cmd = ["--log-level", args.log_level, "router", "--model", args.model, "--host", host,
           "--port", "{router_port}", "--kv-transfer", args.kv_transfer, "--block-size", str(args.block_size),
           "--dtype", args.dtype, "--max-queued-requests", str(args.max_queued_requests),
           "--max-body-bytes", str(args.max_body_bytes), "--prefill-policy", args.prefill_policy,
           "--decode-policy", args.decode_policy, "--local-prefill-threshold", str(args.local_prefill_threshold),
           *placement_flags(args)]
    cmd += ["--session-affinity"] if args.session_affinity else []
    # A chat template is read by each router on its own machine: give a path every machine has.
    cmd += ["--chat-template", args.chat_template] if getattr(args, "chat_template", None) else []
    cmd += ["--tool-call-parser", args.tool_call_parser] if getattr(args, "tool_call_parser", None) else []
    cmd += ["--served-model-name", *args.served_model_name] if getattr(args, "served_model_name", None) else []
    cmd += ["--pooling", args.pooling] if getattr(args, "pooling", None) else []
    cmd += lora_flags(args, router=True)  # adapter directories: a path every machine has
    if getattr(args, "ssl_certfile", None):
        raise ValueError("--ssl-keyfile/--ssl-certfile: not with --ray (its health checks speak HTTP); "
                         "terminate TLS in front of the routers")
    cmd += http_flags(args)
    return cmd + (["--protect-metrics"] if args.protect_metrics else [])


def placement(args) -> Placement:
    roles = {role: res for role, res in (("prefill", args.ray_prefill_resource),
                                          ("decode", args.ray_decode_resource),
                                          ("encode", getattr(args, "ray_encode_resource", None))) if res}
    # The API key reaches the routers through their environment, as `pdserve up` passes it: a
    # command line is visible to every user of a machine.
    key = args.api_key or os.environ.get("PDSERVE_API_KEY")
    return Placement(threads_per_node=args.threads_per_node or 1, gpus_per_node=args.ray_gpus_per_node,
                     role_resources=roles, max_restarts=args.ray_max_restarts,
                     # a node's ranks, every stage's: one bundle each in its placement group
                     role_tp={role: pool_degree(args, role) * pool_degree(args, role, "pp")
                              for role in ("prefill", "decode")},
                     router_env={"PDSERVE_API_KEY": key} if key else {})


def node_counts(args) -> dict[str, int]:
    """Nodes to start per role, in start order (encoder nodes last: routers fall back without them)."""
    return {"prefill": args.prefill_nodes, "decode": args.decode_nodes, "encode": getattr(args, "encode_nodes", 0)}


def wait_ready(urls: list[str], expected: int, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Every router lists `expected` nodes, all healthy."""
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        for url in list(pending):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                    nodes = json.loads(resp.read())["nodes"]
                if len(nodes) == expected and all(n["healthy"] for n in nodes):
                    pending.remove(url)
            except (OSError, ValueError, KeyError):
                pass
        time.sleep(0.5)
    if pending:
        raise TimeoutError(f"routers {pending} did not see {expected} healthy nodes within {timeout_s:.0f} s")


def run_up_ray(args, cluster) -> int:
    import ray  # optional dependency: ray (the pdserve[ray] extra)
    templates = node_templates(args, cluster)  # bad flags fail before connecting
    # The driver joins the Ray node of its own machine (Ray finds its raylet), so it runs on a
    # machine of the cluster, bound to the addresses Ray uses there.
    ray.init(address=args.ray, namespace="pdserve", log_to_driver=True)
    # The controller lives on the head, wherever the driver runs: the registry and the owner's
    # admin server then sit beside Ray's own control plane, at the head's Ray node address.
    controller = ray.remote(RayController).options(num_cpus=0, max_restarts=0, resources=ON_HEAD).remote(
        templates, placement(args))

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        registry = ray.get(controller.registry_address.remote())
        counts = node_counts(args)
        for role, count in counts.items():
            ray.get([controller.start_node.remote(role) for _ in range(count)])
        urls = ray.get(controller.start_routers.remote(args.routers, args.port))
        wait_ready(urls, sum(counts.values()))
        print(f"pdserve up --ray: {' '.join(u + '/v1' for u in urls)} serving {args.model} with "
              f"{', '.join(f'{n} {role}' for role, n in counts.items())} nodes (kv transfer: "
              f"{args.kv_transfer}; registry {registry})", flush=True)
        while True:
            ray.get(controller.ping.remote(), timeout=30)
            time.sleep(1.0)
    except KeyboardInterrupt:
        log.info("stopping the cluster")
        return 0
    except (ray.exceptions.RayError, TimeoutError, ValueError) as exc:
        log.error("%s", exc)
        return 1
    finally:
        _stop(ray, controller)


def _stop(ray, controller) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave actors behind
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        ray.get(controller.shutdown.remote(), timeout=120)
    except Exception as exc:  # the controller is gone: its actors went with it (Ray fate-sharing)
        log.warning("controller shutdown: %s", exc)
    ray.kill(controller)
    ray.shutdown()
