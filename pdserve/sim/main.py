"""`pdserve simulate`: run one trace per cluster size through each routing policy and print a
table (and optionally JSON and a PNG). Load scales with the cluster: sessions and their arrival
rate are given per prefill/decode pair, so every size runs at the same utilisation."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from pdserve.router.placement.policy import POLICIES
from pdserve.sim.costs import NodeCosts, calibrate
from pdserve.sim.elastic import add_elastic_args, run_elastic_eval
from pdserve.sim.report import Summary, plot, summarize, table
from pdserve.sim.simulator import ClusterSpec, Simulator
from pdserve.sim.trace import TraceConfig, make_trace


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", default="4,16,64", help="cluster sizes: N prefill and N decode nodes each")
    p.add_argument("--policies", default=",".join(POLICIES), help="routing policies to compare (both roles)")
    p.add_argument("--sessions-per-node", type=int, default=40, help="chat sessions per node pair")
    p.add_argument("--rate-per-node", type=float, default=0.5, help="new sessions per second per node pair")
    p.add_argument("--rounds", type=int, default=4, help="turns per session")
    p.add_argument("--system-prompts", type=int, default=8, help="distinct shared system prompts")
    p.add_argument("--system-prompt-tokens", type=int, default=1024, help="tokens per system prompt")
    p.add_argument("--first-turn-tokens", type=int, default=128, help="tokens of a session's first user turn")
    p.add_argument("--turn-tokens", type=int, default=64, help="tokens of each later user turn")
    p.add_argument("--output-tokens", type=int, default=64, help="tokens of each answer")
    p.add_argument("--think-time-s", type=float, default=2.0, help="mean pause between turns (exponential)")
    p.add_argument("--kv-blocks", type=int, default=2048, help="KV blocks per node")
    p.add_argument("--max-seqs", type=int, default=64, help="requests a decode node batches at most")
    p.add_argument("--transfer", choices=["nixl", "store"], default="nixl",
                   help="store: prefill nodes also write every prompt to the shared store")
    p.add_argument("--local-prefill-threshold", type=int, default=0,
                   help="as the router's flag: decode nodes compute at most this many missing tokens")
    p.add_argument("--no-prefix-caching", action="store_true", help="nodes reuse no cached blocks")
    p.add_argument("--costs", default=None, help="NodeCosts JSON (from --calibrate); default: built-in figures")
    p.add_argument("--calibrate", action="store_true", help="measure the engine's costs, print JSON, exit")
    p.add_argument("--model", default="builtin:tiny", help="model for --calibrate")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace")
    p.add_argument("--json", default=None, help="write the summaries here")
    p.add_argument("--plot", default=None, help="write a PNG here")
    add_elastic_args(p)


def simulate(n: int, policy: str, args: argparse.Namespace, costs: NodeCosts) -> Summary:
    trace = make_trace(TraceConfig(
        sessions=args.sessions_per_node * n, rounds=args.rounds, system_prompts=args.system_prompts,
        system_prompt_tokens=args.system_prompt_tokens, first_turn_tokens=args.first_turn_tokens,
        turn_tokens=args.turn_tokens, output_tokens=args.output_tokens, arrival_rate=args.rate_per_node * n,
        think_time_s=args.think_time_s, seed=args.seed))
    spec = ClusterSpec(n, n, args.kv_blocks, args.max_seqs, transfer=args.transfer,
                       prefix_caching=not args.no_prefix_caching, prefill_policy=policy, decode_policy=policy,
                       local_prefill_threshold=args.local_prefill_threshold)
    return summarize(f"{n}P{n}D {policy}", Simulator(spec, costs, trace).run(), costs.block_bytes)


def run_simulate(args: argparse.Namespace) -> int:
    if args.elastic:
        return run_elastic_eval(args)
    if args.calibrate:
        print(calibrate(args.model).to_json())
        return 0
    costs = NodeCosts.load(args.costs) if args.costs else NodeCosts()
    rows = []
    for n in (int(x) for x in args.nodes.split(",")):
        for policy in args.policies.split(","):
            t0 = time.perf_counter()
            rows.append(simulate(n, policy, args, costs))
            print(f"simulated {rows[-1].label}: {rows[-1].requests} requests in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"costs": dataclasses.asdict(costs), "rows": [r.row() for r in rows]}, f, indent=2)
    if args.plot:
        plot(rows, args.plot)
    return 0
