"""Elastic pools in the simulator: the SLA planner's real code (pdserve.cluster.planner) resizing and
re-splitting a modelled cluster as the trace's mix shifts, against every fixed split.

A node started costs `startup_s` (a process start and weight load, bench_role_switch) before it
takes work; a node switched drains (prefill: its queue; decode: every request routed to it),
then costs `switch_s`; a node removed drains, then leaves. Node-seconds count every node from its
start to its removal, starting and draining included. A request attains its SLO when its TTFT and
its mean inter-token time are both within target.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from pdserve.cluster.planner import PlannerConfig, PoolSnapshot, SlaPlanner
from pdserve.router.placement.pd_decision import Targets
from pdserve.sim.costs import NodeCosts
from pdserve.sim.nodes import PrefixCache, SimDecodeNode, SimPrefillNode, SimRequest
from pdserve.sim.simulator import ClusterSpec, Simulator
from pdserve.sim.trace import Session

DRAIN_CHECK_S = 0.05
PLANNER_INTERVAL_S = 1.0  # the evaluation's --planner-interval-s


@dataclass
class Phase:
    duration_s: float
    rate: float              # requests per second (Poisson)
    prompt_tokens: int
    output_tokens: int


def phase_trace(phases: list[Phase], seed: int = 0, vocab: int = 250) -> list[Session]:
    """One-round requests with unique prompts (no shared prefix), the mix changing by phase."""
    rng = random.Random(seed)
    sessions, start = [], 0.0
    for phase in phases:
        t = start
        while True:
            t += rng.expovariate(phase.rate)
            if t >= start + phase.duration_s:
                break
            prompt = [rng.randrange(vocab) for _ in range(phase.prompt_tokens)]
            output = [rng.randrange(vocab) for _ in range(phase.output_tokens)]
            sessions.append(Session(len(sessions), t, [], [prompt], [output], [0.0]))
        start += phase.duration_s
    return sessions


def shifting_phases(nodes: int, duration_s: float = 60.0) -> list[Phase]:
    """Long prompts with short answers, then short prompts with long answers, then a burst of
    both; rates scale with the cluster so every size is loaded alike."""
    k = nodes / 16
    return [Phase(duration_s, 24 * k, 2048, 4),
            Phase(duration_s, 110 * k, 64, 256),
            Phase(duration_s / 3, 14 * k, 2048, 4),
            Phase(duration_s / 3, 70 * k, 64, 256)]


@dataclass
class ElasticResult:
    label: str
    requests: int
    attainment: float        # share of requests with TTFT and mean ITL within their SLOs
    node_seconds: float
    switches: int = 0
    starts: int = 0
    removals: int = 0


class ElasticSimulator(Simulator):
    def __init__(self, spec: ClusterSpec, costs: NodeCosts, sessions: list[Session], planner: SlaPlanner | None = None,
                 interval_s: float = 2.0, startup_s: float = 8.5, switch_s: float = 0.7):
        super().__init__(spec, costs, sessions)
        self.sla, self.interval_s, self.startup_s, self.switch_s = planner, interval_s, startup_s, switch_s
        self.alive = spec.prefill_nodes + spec.decode_nodes
        self.node_seconds, self._alive_since = 0.0, 0.0
        self.drain_then: dict[str, str] = {}  # draining node id -> "prefill" | "decode" | "remove"
        self.counts = {"switches": 0, "starts": 0, "removals": 0}
        self._seen_done = 0
        self._next_id = {"prefill": spec.prefill_nodes, "decode": spec.decode_nodes}
        # Nodes on their way into a role (starting, or draining to switch into it): the planner
        # counts them as members already, as the router counts a node from its StartNode.
        self.pending = {"prefill": 0, "decode": 0}
        self._arrived_tokens, self._last_tick = 0, 0.0
        self.history: list[tuple[float, int, int]] = []  # (time, prefill, decode) the planner aims at

    def route(self, req: SimRequest) -> None:
        self._arrived_tokens += len(req.prompt)
        super().route(req)

    def run(self) -> list[SimRequest]:
        if self.sla is not None:
            self.at(self.interval_s, self.tick)
        done = super().run()
        self._set_alive(0)
        return done

    def _set_alive(self, alive: int) -> None:
        self.node_seconds += self.alive * (self.now - self._alive_since)
        self.alive, self._alive_since = alive, self.now

    # ---- the planner ----------------------------------------------------------------------
    def tick(self) -> None:
        decision = self.sla.decide(self.snapshot())
        if decision.kind != "none":
            self.act(decision.prefill, decision.decode)
        self.history.append((self.now, decision.prefill, decision.decode))
        if len(self.done) < len(self.sessions):
            self.at(self.now + self.interval_s, self.tick)

    def active(self, role: str) -> list:
        nodes = self.prefill if role == "prefill" else self.decode
        return [n for n in nodes.values() if n.node_id not in self.draining]

    def snapshot(self) -> PoolSnapshot:
        recent, self._seen_done = self.done[self._seen_done:], len(self.done)
        ttft = sorted(r.first_token - r.arrival for r in recent)
        itl = sorted((r.finish - r.first_token) / (r.output_tokens - 1) for r in recent if r.output_tokens > 1)
        decode = self.active("decode")
        total = sum(d.total_blocks for d in decode)
        rate = self._arrived_tokens / max(self.now - self._last_tick, 1e-9)
        self._arrived_tokens, self._last_tick = 0, self.now
        return PoolSnapshot(len(self.active("prefill")) + self.pending["prefill"],
                            len(decode) + self.pending["decode"],
                            ttft[int(0.9 * (len(ttft) - 1))] if ttft else None,
                            itl[int(0.9 * (len(itl) - 1))] if itl else None,
                            prefill_queue_tokens=sum(p.queued_tokens for p in self.active("prefill")),
                            prefill_s_per_token=self.costs.prefill_s_per_token, prefill_tokens_per_s=rate,
                            decode_running=sum(len(d.running) for d in decode),
                            decode_waiting=sum(len(d.waiting) for d in decode),
                            decode_free_kv_fraction=sum(d.free_blocks for d in decode) / total if total else 1.0)

    def act(self, want_prefill: int, want_decode: int) -> None:
        want = {"prefill": want_prefill, "decode": want_decode}
        have = {role: self.active(role) for role in want}
        gain = {role: want[role] - len(have[role]) - self.pending[role] for role in want}
        for role, other in (("prefill", "decode"), ("decode", "prefill")):
            # A switch covers both; the last active node of a role stays (those joining are not yet).
            moved = min(max(gain[role], 0), max(-gain[other], 0), len(have[other]) - 1)
            for node in self._least_busy(have[other])[:moved]:
                self.drain(node.node_id, role)
                self.counts["switches"] += 1
            have[other] = [n for n in have[other] if n.node_id not in self.draining]
            gain[role] -= moved
            gain[other] += moved
        for role in want:
            for _ in range(max(gain[role], 0)):
                self.start_node(role)
            for node in self._least_busy(have[role])[:min(max(-gain[role], 0), len(have[role]) - 1)]:
                self.drain(node.node_id, "remove")

    def _least_busy(self, nodes: list) -> list:
        return sorted(nodes, key=lambda n: (getattr(n, "routed", 0) + len(getattr(n, "queue", ())), n.node_id))

    # ---- node changes ---------------------------------------------------------------------
    def start_node(self, role: str) -> None:
        node_id = f"{role}-{self._next_id[role]}"
        self._next_id[role] += 1
        self._set_alive(self.alive + 1)
        self.counts["starts"] += 1
        self.pending[role] += 1
        self.at(self.now + self.startup_s, self._join, node_id, role, PrefixCache(node_id, self.index))

    def _join(self, node_id: str, role: str, cache: PrefixCache) -> None:
        self.pending[role] -= 1
        if role == "prefill":
            self.prefill[node_id] = SimPrefillNode(node_id, cache, self.spec.kv_blocks)
        else:
            self.decode[node_id] = SimDecodeNode(node_id, cache, self.spec.kv_blocks, self.spec.max_seqs)

    def drain(self, node_id: str, then: str) -> None:
        if not self.drain_then:
            self.at(self.now + DRAIN_CHECK_S, self._check_drains)
        self.draining.add(node_id)
        self.drain_then[node_id] = then
        if then != "remove":
            self.pending[then] += 1

    def _check_drains(self) -> None:
        for node_id, then in list(self.drain_then.items()):
            p, d = self.prefill.get(node_id), self.decode.get(node_id)
            if (p is not None and (p.queue or p.busy)) or (d is not None and d.routed):
                continue
            node = p or d
            self.prefill.pop(node_id, None)
            self.decode.pop(node_id, None)
            self.draining.discard(node_id)
            del self.drain_then[node_id]
            if then == "remove":
                self._set_alive(self.alive - 1)
                self.counts["removals"] += 1
            else:  # the same cache (the node's KV survives a switch) under the other role
                self.at(self.now + self.switch_s, self._join, node_id, then, node.cache)
        if self.drain_then:
            self.at(self.now + DRAIN_CHECK_S, self._check_drains)


def attainment(done: list[SimRequest], ttft_slo_s: float, itl_slo_s: float) -> float:
    def ok(r: SimRequest) -> bool:
        itl = (r.finish - r.first_token) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        return r.first_token - r.arrival <= ttft_slo_s and itl <= itl_slo_s
    return sum(map(ok, done)) / len(done) if done else 0.0


def run_elastic(label: str, spec: ClusterSpec, costs: NodeCosts, sessions: list[Session], slo: tuple[float, float],
                planner: SlaPlanner | None = None, **timing) -> ElasticResult:
    sim = ElasticSimulator(spec, costs, sessions, planner, **timing)
    done = sim.run()
    return ElasticResult(label, len(done), attainment(done, *slo), sim.node_seconds, **sim.counts)


# ---- `pdserve simulate --elastic`: the planner against every fixed split ---------------------
def add_elastic_args(p) -> None:
    p.add_argument("--elastic", action="store_true",
                   help="elastic pools: the SLA planner against every fixed P:D split on a trace whose mix shifts")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="--elastic: TTFT target")
    p.add_argument("--slo-itl-ms", type=float, default=30.0, help="--elastic: mean inter-token time target")
    p.add_argument("--phase-s", type=float, default=60.0, help="--elastic: seconds per phase of the trace")
    p.add_argument("--placements", default="threshold",
                   help="--elastic: comma-separated: threshold (prompts always on prefill nodes), slo (the router's "
                        "per-request placement against the SLOs, decode nodes chunking to hold the ITL target)")


def planner_for(nodes: int, slo: tuple[float, float]) -> SlaPlanner:
    """The planner as the evaluation runs it (with decisions every PLANNER_INTERVAL_S): two calm
    intervals before a pool gives nodes up, a floor of an eighth of the nodes per role (a pool
    shrunk to one node takes every request of a shifted mix, and a request waits where it was
    routed), up to a quarter of the nodes per step."""
    floor = max(1, nodes // 8)
    return SlaPlanner(PlannerConfig(ttft_slo_s=slo[0], itl_slo_s=slo[1], min_nodes=2 * floor, max_nodes=nodes,
                                    min_prefill=floor, min_decode=floor, calm_intervals=2, cooldown_intervals=1,
                                    max_step=max(2, nodes // 4)))


def evaluate(nodes: int, costs: NodeCosts, slo: tuple[float, float], phase_s: float = 60.0, seed: int = 0,
             kv_blocks: int = 2048, max_seqs: int = 64, step: int | None = None,
             placements: tuple[str, ...] = ("threshold",)) -> list[ElasticResult]:
    """Every fixed split of `nodes` (every `step`-th prefill count), then the planner starting
    from an even split with at most `nodes` nodes; once per placement ("slo": the router's
    per-request placement against the SLOs, labelled "+ placement")."""
    trace = phase_trace(shifting_phases(nodes, phase_s), seed)
    step = step or max(1, nodes // 16)
    rows = []
    for placement in placements:
        tag = " + placement" if placement == "slo" else ""
        extra = dict(placement=placement, targets=Targets(*slo))
        rows += [run_elastic(f"{nodes} fixed {p}P{nodes - p}D{tag}", ClusterSpec(p, nodes - p, kv_blocks, max_seqs,
                                                                                **extra),
                             costs, trace, slo) for p in range(step, nodes, step)]
        rows.append(run_elastic(f"{nodes} planner{tag}", ClusterSpec(nodes // 2, nodes - nodes // 2, kv_blocks, max_seqs,
                                                                    **extra),
                                costs, trace, slo, planner_for(nodes, slo), interval_s=PLANNER_INTERVAL_S))
    return rows


def elastic_table(rows: list[ElasticResult]) -> str:
    lines = ["| run | requests | SLO attainment | node-seconds | switches | starts | removals |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r.label} | {r.requests} | {r.attainment:.1%} | {r.node_seconds:.0f} | {r.switches} | {r.starts} | "
              f"{r.removals} |" for r in rows]
    return "\n".join(lines)


def elastic_plot(rows: list[ElasticResult], path: str) -> None:
    import matplotlib  # optional dependency: matplotlib (the pdserve[plot] extra)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency: matplotlib (the pdserve[plot] extra)
    sizes = sorted({int(r.label.split()[0]) for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4), squeeze=False)
    for ax, n in zip(axes[0], sizes):
        mine = [r for r in rows if int(r.label.split()[0]) == n]
        for tag, color in (("", "grey"), (" + placement", "tab:blue")):
            fixed = [r for r in mine if "fixed" in r.label and r.label.endswith(tag or "D")]
            if fixed:
                ax.plot([r.node_seconds for r in fixed], [r.attainment * 100 for r in fixed], "o", color=color,
                        label=f"fixed splits{tag}")
            for r in fixed:
                ax.annotate(r.label.split()[2], (r.node_seconds, r.attainment * 100), fontsize=7)
        for r in mine:
            if "planner" in r.label:
                color = "tab:green" if "placement" in r.label else "tab:red"
                ax.plot([r.node_seconds], [r.attainment * 100], "*", markersize=14, color=color,
                        label=r.label.split(" ", 1)[1])
        ax.set(title=f"{n} nodes", xlabel="node-seconds", ylabel="SLO attainment (%)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_elastic_eval(args) -> int:
    costs = NodeCosts.load(args.costs) if args.costs else NodeCosts()
    slo = (args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3)
    placements = tuple(args.placements.split(","))
    rows = [r for n in (int(x) for x in args.nodes.split(","))
            for r in evaluate(n, costs, slo, args.phase_s, args.seed, placements=placements)]
    print(elastic_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=2)
    if args.plot:
        elastic_plot(rows, args.plot)
    return 0
