"""The `pdserve` command: one subcommand per job."""
from __future__ import annotations

import argparse
import logging
import sys
from functools import partial
from importlib.util import find_spec

from pdserve import __version__
from pdserve.cluster.planner import add_planner_args
from pdserve.cluster.registry import run_registry
from pdserve.cluster.registry_client import registry_url
from pdserve.engine.config import engine_options
from pdserve.entrypoints.engine_flags import add_context_args, add_engine_args, add_lora_module_arg
from pdserve.entrypoints.http_flags import add_http_args
from pdserve.entrypoints.router_flags import add_admission_args, add_chat_args, add_routing_args, add_served_name_args
from pdserve.entrypoints.scale_cli import add_scale_args, run_scale
from pdserve.entrypoints.serve_cli import check_model, run_checked_up, run_serve
from pdserve.entrypoints.tp_degrees import parse_degrees
from pdserve.entrypoints.vllm_flags import add_serve_args, add_up_hints, brief_errors
from pdserve.models.gguf import DEFAULT_MODEL
from pdserve.sim.main import add_simulate_args, run_simulate
from pdserve.wire.curve_keys import run_keys

# Push mode's layer-wise WRITEs: a step's blocks go in this many slices of layers (node.push_writes).
PUSH_LAYER_GROUPS = 4
PUSH_LAYER_GROUPS_HELP = ("push mode: WRITE a step's blocks in this many groups of layers, each as soon as its last "
                          "layer has stored its KV, while the later layers compute (layer-wise streaming); 0: whole "
                          "blocks after each step")
# Push mode over the store: --prefetch-stored-prefix (node.decode's prefetch_stored_prefix).
PREFETCH_HELP = ("push mode over the store: a decode node loads the leading blocks the store already holds "
                 "(an earlier turn's) while the prefill node computes the prompt, once the prefill node's own "
                 "load of them is over, instead of after the first token. Off by default: on one machine the "
                 "load's CPU (Redis', the disk's) still slows the prefill node's compute, hence the first "
                 "token, while the second comes sooner (docs: the handover)")


def layer_groups(text: str) -> int:
    """--push-layer-groups: a count of groups, 0 for none."""
    count = int(text)
    if count < 0:
        raise argparse.ArgumentTypeError(f"{count} groups of layers: give 0 (whole blocks) or more")
    return count


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams  # heavy: LLM loads torch and the engine, for `pdserve generate` only
    llm = LLM(args.model, **engine_options(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for out in llm.generate(args.prompts or ["Hello, my name is"], params):
        print(f"prompt: {out.prompt!r}\noutput: {out.outputs[0].text!r} "
              f"({len(out.outputs[0].token_ids)} tokens, finish_reason={out.outputs[0].finish_reason})")
    return 0


def _default_transfer() -> str:
    return "nixl" if find_spec("nixl") is not None else "store"


def _add_node_args(p: argparse.ArgumentParser, role: str) -> None:
    add_engine_args(p)
    add_context_args(p)
    p.add_argument("--node-id", default=f"{role}-0", help="the name the router, logs and metrics use")
    p.add_argument("--bind", default="tcp://127.0.0.1:5600", help="zmq endpoint for the router")
    p.add_argument("--step-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)  # fault injection
    p.add_argument("--store", default=None,
                   help="KV store URL: redis://host:port (LMCache tiers, the default), direct+redis://, memory://")
    _add_store_args(p)
    p.add_argument("--seed", type=int, default=None,
                   help="seed the node's random generators: requests that give no seed draw from them")
    p.add_argument("--kv-timeout-s", type=float, default=30.0,
                   help="how long a request may wait for its KV before it is computed locally")
    p.add_argument("--registry", default=None, type=registry_url,
                   help="the node registry, tcp://host:port (`pdserve registry`) or redis://host:port[/db]: "
                        "the node registers itself there, and routers watching it route to the node (pair "
                        "with --advertise-host when bound to 0.0.0.0)")
    _add_curve_args(p)


def _add_store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store-chunk-tokens", type=int, default=None,
                   help="tokens per LMCache chunk, a multiple of --block-size (default 256, measured)")
    p.add_argument("--lmcache-config", default=None,
                   help="LMCache config file (its own keys: chunk_size, local_cpu, max_local_cpu_size, "
                        "local_disk, max_local_disk_size, remote_url, ...; default: $LMCACHE_CONFIG_FILE)")


def _add_curve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--curve-dir", default=None,
                   help="ZeroMQ CURVE key directory from `pdserve keys`: node sockets are encrypted and "
                        "nodes accept only the router's key (default: plain TCP)")


def _add_speculative_args(p: argparse.ArgumentParser, where: str = "", per_node: str = "") -> None:
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding" + where + ", vLLM's keys: "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' "
                        "or '{\"method\": \"draft_model\", \"model\": DIR, \"num_speculative_tokens\": 4}'; "
                        "method eagle takes an EAGLE-1 head's DIR, mtp a DeepSeek-V3 checkpoint's own MTP layer, "
                        "suffix (suffix decoding) the suffix_decoding_* keys"
                        + per_node + " (docs/speculative-decoding.md)")


def _add_keys_parser(sub) -> None:
    keys = sub.add_parser("keys", help="write the router and node CURVE key pairs for --curve-dir")
    keys.add_argument("--out", required=True, help="directory to write them into (created 0700)")
    keys.add_argument("--force", action="store_true", help="replace existing secret keys")
    keys.set_defaults(func=run_keys)


def _run_node(role: str, args: argparse.Namespace) -> int:
    """`pdserve prefill` and `pdserve decode`; a node given --seed seeds torch's generators before it
    starts (vLLM's --seed)."""
    # deferred: the node's engine, KV store and CURVE modules (torch once it serves), loaded by the
    # node process only, not by `pdserve --help` or the router
    from pdserve.node.main import serve_node
    if args.seed is not None:
        import torch  # heavy: only in a node process, which loads it anyway
        torch.manual_seed(args.seed)
    return serve_node(role, args)


def _run_router(args: argparse.Namespace) -> int:
    """`pdserve router`."""
    # deferred: the router's FastAPI app, its node pool and numpy, loaded by the router process only,
    # not by `pdserve --help` or the nodes
    from pdserve.router.main import run_router
    check_model(args)  # a model that does not resolve, or a --max-model-len beyond it: exit 2, not a crash
    return run_router(args)


def _add_cluster_parsers(sub) -> None:
    pre = sub.add_parser("prefill", help="run one prefill node")
    _add_node_args(pre, "prefill")
    pre.set_defaults(func=partial(_run_node, "prefill"))
    dec = sub.add_parser("decode", help="run one decode node")
    _add_node_args(dec, "decode")
    for p in (pre, dec):  # a decode node uses them once switched to prefill (pdserve scale --switch)
        p.add_argument("--nixl-side-channel", default=None, help="zmq endpoint serving NIXL metadata")
        p.add_argument("--lease-s", type=float, default=30.0, help="seconds NIXL-pinned blocks are kept")
        p.add_argument("--push-layer-groups", type=layer_groups, default=PUSH_LAYER_GROUPS, help=PUSH_LAYER_GROUPS_HELP)
        p.add_argument("--advertise-host", default=None,
                       help="host name decode nodes dial for the side channel (when bound to 0.0.0.0)")
    dec.add_argument("--nixl", action="store_true", help="pull KV over NIXL")
    dec.add_argument("--on-transfer-failure", choices=["recompute", "fail"], default="recompute",
                     help="when a KV pull fails: compute the prompt here, or fail the request")
    dec.add_argument("--pull-delay-s", type=float, default=0.0, help="fault injection: delay each KV pull")
    dec.add_argument("--prefetch-stored-prefix", action="store_true", help=PREFETCH_HELP)
    _add_speculative_args(dec)
    dec.set_defaults(func=partial(_run_node, "decode"))
    enc = sub.add_parser("encode", help="run one encoder node: a vision-language model's image encoder (E/P/D)")
    _add_node_args(enc, "encode")
    enc.add_argument("--nixl-side-channel", default=None,
                     help="zmq endpoint serving NIXL metadata: embeddings are handed over by NIXL READ "
                          "(else through --store)")
    enc.add_argument("--lease-s", type=float, default=30.0, help="seconds NIXL-pinned embeddings are kept")
    enc.add_argument("--advertise-host", default=None,
                     help="host name prefill nodes dial for the side channel (when bound to 0.0.0.0)")
    enc.set_defaults(func=partial(_run_node, "encode"))
    rt = sub.add_parser("router", help="run the OpenAI-compatible router")
    rt.add_argument("--model", default=DEFAULT_MODEL, help="the served model: its tokenizer and name")
    rt.add_argument("--host", default="127.0.0.1", help="HTTP address")
    rt.add_argument("--port", type=int, default=8000, help="HTTP port")
    rt.add_argument("--prefill", action="append", help="a prefill node's zmq endpoint (repeat)")
    rt.add_argument("--decode", action="append", help="a decode node's zmq endpoint (repeat)")
    rt.add_argument("--encode", action="append",
                    help="an encoder node's zmq endpoint (repeat): images are encoded there (E/P/D)")
    rt.add_argument("--registry", default=None, type=registry_url,
                    help="the node registry, tcp://host:port (`pdserve registry`) or redis://host:port[/db]: "
                         "route to every node registered there (besides any --prefill/--decode), as nodes "
                         "come and go")
    rt.add_argument("--owner", default=None, help="zmq admin endpoint of the node owner (`pdserve up` passes "
                    "its own): POST /admin/scale starts and stops nodes through it")
    rt.add_argument("--kv-transfer", choices=["nixl", "store"], default=_default_transfer(),
                    help="how prefill nodes hand KV to decode nodes")
    rt.add_argument("--block-size", type=int, default=16, help="the nodes' --block-size (for block keys)")
    rt.add_argument("--dtype", default="auto", help="the nodes' --dtype")
    rt.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "bfloat16"], help="the nodes' --kv-cache-dtype")
    add_http_args(rt)
    add_lora_module_arg(rt)
    _add_curve_args(rt)
    add_admission_args(rt)
    add_routing_args(rt)
    add_planner_args(rt)
    add_chat_args(rt)
    add_served_name_args(rt)
    rt.set_defaults(func=_run_router)
    up = sub.add_parser("up", help="start a local cluster: router, prefill and decode nodes (and Redis)")
    add_up_args(up)
    add_up_hints(up)  # vLLM's flags it does not take answer with their equivalent
    brief_errors(up)
    up.set_defaults(func=run_checked_up)
    serve = sub.add_parser("serve", help="`vllm serve` for pdserve: `pdserve up` with MODEL first and vLLM's flags "
                                         "(docs/from-vllm.md)")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model (as --model)")
    add_up_args(serve)
    add_serve_args(serve)
    brief_errors(serve)
    serve.set_defaults(func=run_serve)
    reg = sub.add_parser("registry", help="run a node registry for nodes and routers started by hand")
    reg.add_argument("--bind", default="tcp://127.0.0.1:5700",
                     help="zmq endpoint; nodes and routers take it as --registry (use a reachable address)")
    reg.set_defaults(func=run_registry)


def add_up_args(up: argparse.ArgumentParser) -> None:
    """`pdserve up`'s flags, which `pdserve serve` takes too, with the same defaults."""
    add_engine_args(up, tensor_parallel=False)
    up.add_argument("--host", default="127.0.0.1", help="the router's HTTP address")
    up.add_argument("--port", type=int, default=8000, help="the router's HTTP port")
    up.add_argument("--prefill-nodes", type=int, default=1, help="0 runs whole requests on decode nodes")
    up.add_argument("--decode-nodes", type=int, default=1, help="decode nodes to start")
    up.add_argument("--encode-nodes", type=int, default=0,
                    help="encoder nodes to start for a vision-language model (E/P/D): they encode images and "
                         "hand the embeddings to prefill nodes as the KV goes (--kv-transfer): by NIXL READ or "
                         "through the store; 0: prefill nodes encode")
    up.add_argument("--kv-transfer", choices=["nixl", "store"], default=_default_transfer(),
                    help="how prefill nodes hand KV to decode nodes")
    up.add_argument("--store", default=None,
                    help="redis://host:port (LMCache: CPU -> disk -> Redis tiers, the default), "
                         "direct+redis://host:port (pdserve's direct Redis client); with no host (e.g. "
                         "direct+redis://) or no --store, --kv-transfer store starts a redis-server for the cluster")
    _add_store_args(up)
    up.add_argument("--lease-s", type=float, default=30.0, help="seconds NIXL-pinned blocks are kept")
    up.add_argument("--push-layer-groups", type=layer_groups, default=PUSH_LAYER_GROUPS, help=PUSH_LAYER_GROUPS_HELP)
    up.add_argument("--prefetch-stored-prefix", action="store_true", help=PREFETCH_HELP)
    up.add_argument("--on-transfer-failure", choices=["recompute", "fail"], default="recompute",
                    help="when a KV pull fails: compute the prompt on the decode node, or fail the request")
    for role in ("prefill", "decode"):
        up.add_argument(f"--{role}-tp", type=parse_degrees, default="1", metavar="N[,N...]",
                        help=f"tensor-parallel size of each {role} node; a comma list gives the {role} nodes "
                             f"their sizes in turn ({role}-i: entry i mod the list's length)")
        up.add_argument(f"--{role}-pp", type=parse_degrees, default="1", metavar="N[,N...]",
                        help=f"pipeline stages of each {role} node (each stage --{role}-tp ranks); a comma list "
                             f"gives the {role} nodes theirs in turn")
    _add_speculative_args(up, " on the decode nodes (they run whole requests too, with --prefill-nodes 0)",
                          "; a JSON list of them gives the decode nodes theirs in turn (decode-i: entry i mod "
                          "the list's length; null: no speculation on that node)")
    up.add_argument("--threads-per-node", type=int, default=None,
                    help="compute threads per node (default: the machine's cores divided among the nodes)")
    up.add_argument("--lend-idle-cores", action=argparse.BooleanOptionalAction, default=True,
                    help="a node runs a long prompt's step on its own threads plus those of the nodes idle for "
                         "0.25 s (nodes of one rank; on by default, --no-lend-idle-cores: each node keeps its "
                         "share; see docs/disaggregation.md)")
    up.add_argument("--lend-min-prompt-tokens", type=int, default=None,
                    help="--lend-idle-cores: a step borrows cores only for a prompt with at least this many "
                         "tokens left to compute (default 512; 0: every step, a decode node's too)")
    add_admission_args(up)
    add_routing_args(up)
    add_planner_args(up)
    add_chat_args(up)
    add_served_name_args(up)
    up.add_argument("--curve", action="store_true",
                    help="fresh CURVE keys in a private temporary directory for every node and the router")
    up.add_argument("--decode-pull-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)  # fault injection
    # fault injection: every node sleeps this long after each step, so a test's kill lands mid-stream
    # however fast the machine decodes (a tiny model's 400 tokens took under a second)
    up.add_argument("--node-step-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    add_http_args(up)
    _add_ray_args(up)


def _add_ray_args(up: argparse.ArgumentParser) -> None:
    up.add_argument("--ray", default=None, metavar="ADDRESS",
                    help="run the nodes and routers as actors on the Ray cluster at ADDRESS (host:port, or auto: "
                         "$RAY_ADDRESS or the local one); needs the ray extra (pip install 'pdserve[ray]')")
    up.add_argument("--routers", type=int, default=1, help="router replicas; router i listens on --port + i")
    up.add_argument("--ray-gpus-per-node", type=float, default=0.0, help="GPUs Ray reserves for each node")
    up.add_argument("--ray-prefill-resource", default=None,
                    help="a custom Ray resource every prefill node needs (pins the role to machines that have it)")
    up.add_argument("--ray-decode-resource", default=None, help="the same, for decode nodes")
    up.add_argument("--ray-encode-resource", default=None, help="the same, for encoder nodes (--encode-nodes)")
    up.add_argument("--ray-max-restarts", type=int, default=20,
                    help="times Ray restarts a node or router whose process or machine died (-1: always)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation, printed to stdout")
    add_engine_args(gen)
    add_context_args(gen)
    _add_speculative_args(gen)
    gen.add_argument("prompts", nargs="*", help="prompts to complete (default: one example prompt)")
    gen.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.set_defaults(func=cmd_generate)
    _add_cluster_parsers(sub)
    scale = sub.add_parser("scale", help="resize a running cluster or switch a node's role (router admin API)")
    add_scale_args(scale)
    scale.set_defaults(func=run_scale)
    _add_keys_parser(sub)
    sim = sub.add_parser("simulate", help="discrete-event simulation of the router's policies on modelled nodes")
    add_simulate_args(sim)
    sim.set_defaults(func=run_simulate)
    sub.add_parser("bench", help="load generator for any OpenAI-compatible endpoint (pdserve bench --help)")
    sub.add_parser("bench-plot", help="draw saved `pdserve bench --output-json` runs on one figure")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # every flag belongs to the load generator, --help included
        from pdserve.loadgen.cli import main as bench_main  # deferred: the load generator (aiohttp)
        return bench_main(argv[1:])
    if argv[:1] == ["bench-plot"]:
        # deferred: the load generator (aiohttp), which only `pdserve bench-plot` runs
        from pdserve.loadgen.plot import plot_main
        return plot_main(argv[1:])
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # named with the command and where vLLM's flags are mapped, not the top-level usage
        print(f"pdserve {args.command}: error: unrecognized arguments: {' '.join(unknown)} (`pdserve "
              f"{args.command} --help` lists its flags; docs/from-vllm.md maps vLLM's)", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:  # bad flags or model: a clear message, not a traceback
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
