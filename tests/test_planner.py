"""The SLA planner's decisions on hand-computed cases (pure logic: no sockets, no clock)."""
from __future__ import annotations

import pytest

from pdserve.cluster.planner import Decision, PlannerConfig, PoolSnapshot, SlaPlanner


def planner(**overrides) -> SlaPlanner:
    config = dict(ttft_slo_s=0.2, itl_slo_s=0.05, min_nodes=2, max_nodes=4, calm_intervals=3, cooldown_intervals=2)
    return SlaPlanner(PlannerConfig(**{**config, **overrides}))


def snap(p: int, d: int, ttft: float | None = None, itl: float | None = None, **extra) -> PoolSnapshot:
    return PoolSnapshot(prefill_nodes=p, decode_nodes=d, ttft_p90_s=ttft, itl_p90_s=itl, **extra)


def test_prefill_past_its_slo_scales_prefill_in_proportion():
    # TTFT 0.6 s against 0.2 s: 3x. One prefill node would need ceil(1 * 3) = 3, so +2 (the step
    # cap), and max_nodes 4 leaves room for both. Decode at 0.8 of its SLO neither needs nor spares.
    d = planner().decide(snap(1, 1, ttft=0.6, itl=0.04))
    assert (d.kind, d.prefill, d.decode) == ("scale", 3, 1)
    assert any("TTFT p90 600 ms" in r for r in d.reasons)


def test_room_for_one_only():
    d = planner(max_nodes=3).decide(snap(1, 1, ttft=0.6, itl=0.04))
    assert (d.kind, d.prefill, d.decode) == ("scale", 2, 1)


def test_a_calm_decode_pool_gives_a_node_by_switch_once_calm_long_enough():
    # At max_nodes (3): prefill needs a node; decode runs at 0.2 of its SLO. It can spare one only
    # after 3 calm intervals in a row: twice nothing, then a switch (cheaper than a new node).
    p = planner(max_nodes=3)
    first, second, third = (p.decide(snap(1, 2, ttft=0.5, itl=0.01)) for _ in range(3))
    assert first.kind == second.kind == "none"
    assert any("--max-nodes 3" in r for r in first.reasons)
    assert (third.kind, third.prefill, third.decode, third.switch_to) == ("switch", 2, 1, "prefill")


def test_a_switch_is_preferred_to_a_new_node_when_a_pool_is_idle():
    # Room for 4 more nodes, yet decode's need is met by a switch from the prefill pool, which
    # saw no traffic (calm) for 3 intervals.
    p = planner(max_nodes=8, min_nodes=4)
    assert [p.decide(snap(2, 2, itl=0.01)).kind for _ in range(2)] == ["none", "none"]
    d = p.decide(snap(2, 2, ttft=0.05, itl=0.2))  # decode 4x past its SLO
    assert (d.kind, d.prefill, d.decode, d.switch_to) == ("switch", 1, 3, "decode")


def test_cooldown_after_any_action():
    p = planner()
    assert p.decide(snap(1, 1, ttft=0.6)).kind == "scale"
    for _ in range(2):
        d = p.decide(snap(3, 1, ttft=0.6))
        assert d.kind == "none" and "cooling down" in d.reasons
    assert p.decide(snap(3, 1, ttft=0.6)).kind == "none"  # at max_nodes 4 with decode not calm yet


def test_calm_pools_shrink_one_node_at_a_time_to_the_floor():
    p = planner(min_nodes=2)
    decisions = [p.decide(snap(2, 2, ttft=0.01, itl=0.001)) for _ in range(3)]
    assert [d.kind for d in decisions] == ["none", "none", "scale"]
    assert (decisions[-1].prefill, decisions[-1].decode) == (1, 2)
    # Never under min_prefill/min_decode: at 1P1D (= min_nodes 2) nothing more goes.
    p = planner(min_nodes=2)
    assert all(p.decide(snap(1, 1)).kind == "none" for _ in range(6))


def test_full_decode_kv_cache_counts_as_pressure():
    d = planner().decide(snap(1, 2, itl=0.01, decode_free_kv_fraction=0.01))
    assert (d.kind, d.prefill, d.decode) == ("scale", 1, 3)  # ceil(2 * 1.01) - 2 = 1


def test_a_long_prefill_queue_counts_before_ttft_shows_it():
    # 10000 queued tokens at 0.1 ms each on one node: 1.0 s to clear, 5x the 0.2 s SLO -> +2.
    d = planner(max_nodes=6).decide(snap(1, 1, ttft=0.05, prefill_queue_tokens=10_000, prefill_s_per_token=1e-4))
    assert (d.kind, d.prefill, d.decode) == ("scale", 3, 1)
    assert any("10000 tokens" in r for r in d.reasons)


def test_below_min_nodes_grows_the_busier_role():
    d = planner(min_nodes=3).decide(snap(1, 1, ttft=0.1, itl=0.01))
    assert (d.kind, d.prefill, d.decode) == ("scale", 2, 1)  # prefill at 0.5x beats decode at 0.2x


def test_alternating_load_does_not_flap():
    # The mix flips every interval: each pool is past its SLO every other interval, never calm.
    # Without hysteresis that would be a switch per interval; with it, nothing moves between roles.
    p = planner(max_nodes=4)
    kinds = [p.decide(snap(2, 2, ttft=0.4 if i % 2 else 0.05, itl=0.01 if i % 2 else 0.1)).kind for i in range(12)]
    assert "switch" not in kinds
    assert kinds.count("scale") <= 12 // 3  # at most one action per cooldown window


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="exceeds"):
        planner(min_nodes=5, max_nodes=4)
    with pytest.raises(ValueError, match="no room"):
        planner(min_nodes=1, max_nodes=1)
    with pytest.raises(ValueError, match="min-decode-nodes"):
        planner(min_decode=0)
    assert isinstance(planner().decide(snap(1, 1)), Decision)


def test_interval_percentiles_come_from_histogram_deltas():
    from pdserve.router.dispatch.metrics import RouterMetrics
    from pdserve.router.scaling.planner_loop import bucket_counts, interval_quantile
    m = RouterMetrics()
    for x in (5.0, 6.0):  # an earlier interval's slow requests must not count in the next one
        m.ttft.observe(x)
    before = bucket_counts(m.ttft)
    assert interval_quantile(before, bucket_counts(m.ttft), 0.9) is None  # nothing new
    for x in (0.02, 0.03, 0.3, 0.4, 2.0):
        m.ttft.observe(x)
    # 5 new samples: p90 is the 5th, 2.0 s, in the bucket (1, 2.5]; p50 the 3rd, 0.3 s, in (0.25, 0.5].
    assert interval_quantile(before, bucket_counts(m.ttft), 0.9) == 2.5
    assert interval_quantile(before, bucket_counts(m.ttft), 0.5) == 0.5
