"""The SLA planner's real code in the simulator, on a tiny trace whose right answer is known.

Four nodes. First 40 s of long prompts with 4-token answers at 7.5 requests/s: 2.3 node-seconds
of prefill per second (0.15 ms per prompt token, 2048 tokens), so only three prefill nodes keep up,
and one decode node is plenty. Then 40 s of 64-token prompts with 256-token answers at 40
requests/s: about 4 s of decoding each, so some 160 streams in flight, more than two decode nodes
batch (64 each), while one prefill node has time to spare. The right split is 3P1D, then 1P3D; no
fixed split holds both, so the planner must beat every one of them, using fewer node-seconds.
"""
from __future__ import annotations

from pdserve.cluster.planner import PlannerConfig, SlaPlanner
from pdserve.sim.costs import NodeCosts
from pdserve.sim.elastic import ElasticSimulator, Phase, attainment, phase_trace, run_elastic
from pdserve.sim.simulator import ClusterSpec

SLO = (1.0, 0.03)  # TTFT 1 s, mean inter-token time 30 ms
PHASES = [Phase(40, 7.5, 2048, 4), Phase(40, 40, 64, 256)]


def test_planner_finds_the_known_split_and_beats_every_fixed_one():
    trace = phase_trace(PHASES, seed=1)
    costs = NodeCosts()
    fixed = [run_elastic(f"{p}P{4 - p}D", ClusterSpec(p, 4 - p, 2048, 64), costs, trace, SLO) for p in (1, 2, 3)]
    planner = SlaPlanner(PlannerConfig(ttft_slo_s=SLO[0], itl_slo_s=SLO[1], min_nodes=2, max_nodes=4,
                                       calm_intervals=1, cooldown_intervals=1))
    sim = ElasticSimulator(ClusterSpec(2, 2, 2048, 64), costs, trace, planner)
    done = sim.run()

    # The split it aims at, phase by phase: 3P1D within two intervals of the start, held to the
    # shift; 1P3D a few intervals after it (the first decode waits show), held to the end.
    splits = {t: (p, d) for t, p, d in sim.history}
    assert all(splits[t] == (3, 1) for t in splits if 4 <= t <= 40)
    assert all(splits[t] == (1, 3) for t in splits if 46 <= t <= 78)
    assert sim.counts["starts"] == 0 and sim.counts["removals"] == 0  # switches alone, at max_nodes
    assert sim.counts["switches"] >= 3

    got = attainment(done, *SLO)
    assert len(done) == len(trace)
    assert got > max(r.attainment for r in fixed)
    best = max(fixed, key=lambda r: r.attainment)
    assert sim.node_seconds < best.node_seconds
