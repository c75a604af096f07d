"""`pdserve simulate`: a tiny trace with a known answer, policy and cache effects at scale, the
index kept consistent with the modelled caches, and the command itself."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.sim.costs import NodeCosts
from pdserve.sim.report import percentile, summarize
from pdserve.sim.simulator import ClusterSpec, Simulator
from pdserve.sim.trace import TraceConfig, make_trace

# Round numbers so the expected times are easy to follow: 1 ms per prompt token, 10 ms per
# decode step, free transfers.
COSTS = NodeCosts(prefill_s_per_token=1e-3, store_s_per_token=1e-4, decode_step_s=1e-2, decode_s_per_seq=0.0,
                  transfer_s_per_block=0.0, handover_s=0.0, block_bytes=1000, router_s=0.0)


def two_round_session():
    return make_trace(TraceConfig(sessions=1, rounds=2, system_prompts=1, system_prompt_tokens=32,
                                  first_turn_tokens=16, turn_tokens=16, output_tokens=16, arrival_rate=0,
                                  think_time_s=0))


def test_two_rounds_disaggregated_known_answer():
    done = Simulator(ClusterSpec(1, 1, transfer="nixl"), COSTS, two_round_session()).run()
    first, second = sorted(done, key=lambda r: r.round)
    # Round 0: 48 prompt tokens computed (48 ms), then 15 decode steps of 10 ms.
    assert first.first_token == pytest.approx(0.048) and first.finish == pytest.approx(0.198)
    assert first.cached_tokens == 0 and first.handed_blocks == 3
    # Round 1 (80 tokens) at once: the prefill node holds the first 48, computes 32; the decode
    # node holds prompt + reply (64 tokens, 4 blocks), so only the 5th block is handed over.
    assert second.arrival == pytest.approx(0.198)
    assert second.first_token - second.arrival == pytest.approx(0.032)
    assert second.cached_tokens == 48 and second.handed_blocks == 1
    assert summarize("x", done, 1000).hit_rate == pytest.approx(48 / 128)


def test_two_rounds_local_prefill_known_answer():
    spec = ClusterSpec(1, 1, transfer="nixl", local_prefill_threshold=16)
    first, second = sorted(Simulator(spec, COSTS, two_round_session()).run(), key=lambda r: r.round)
    assert first.prefill_node == "prefill-0"  # 48 missing tokens > 16: disaggregated
    # Round 1 lacks 16 tokens on its decode node: it prefills them in its next step (10 + 16 ms).
    assert second.prefill_node is None and second.handed_blocks == 0
    assert second.cached_tokens == 64 and second.local_prefill == 16
    assert second.first_token - second.arrival == pytest.approx(0.026)


def chat_trace(sessions=120):
    return make_trace(TraceConfig(sessions=sessions, rounds=4, system_prompts=4, system_prompt_tokens=256,
                                  arrival_rate=20.0, think_time_s=0.5, seed=3))


def run(policy: str, **spec) -> list:
    return Simulator(ClusterSpec(4, 4, prefill_policy=policy, decode_policy=policy, **spec),
                     NodeCosts(), chat_trace()).run()


def test_cache_aware_beats_round_robin_on_multi_round_chat():
    rr = summarize("rr", run("round_robin", transfer="nixl"), 1)
    ca = summarize("ca", run("cache_aware", transfer="nixl"), 1)
    assert rr.requests == ca.requests == 480
    assert ca.hit_rate > rr.hit_rate + 0.05
    assert ca.moved_mb < rr.moved_mb / 2  # follow-ups find their history on their decode node


def test_prefix_caching_off_reuses_nothing_and_store_restores_reuse():
    assert summarize("off", run("cache_aware", prefix_caching=False), 1).hit_rate == 0.0
    # With the store path every prefill node finds every stored prefix: round robin gets it too.
    assert summarize("rr", run("round_robin", transfer="store"), 1).hit_rate > 0.8


def test_index_matches_modelled_caches_under_eviction():
    sim = Simulator(ClusterSpec(2, 2, kv_blocks=64, transfer="nixl"), NodeCosts(), chat_trace(40))
    done = sim.run()
    assert len(done) == 160
    for node in list(sim.prefill.values()) + list(sim.decode.values()):
        assert len(node.cache.keys) <= 64
        held = {k for k, nodes in sim.index.holders.items() if node.node_id in nodes}
        # The router also adds routed keys before events; evictions must still have reached it.
        assert set(node.cache.keys) <= held


def test_percentile_nearest_rank():
    assert percentile([5, 1, 3, 2, 4], 50) == 3 and percentile([1, 2, 3, 4], 99) == 4
    assert percentile([], 50) == 0.0


def test_pdserve_simulate_command_writes_table_json_and_plot(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pdserve", "simulate", "--nodes", "2", "--sessions-per-node", "5",
                          "--policies", "round_robin,cache_aware", "--json", str(tmp_path / "s.json"),
                          "--plot", str(tmp_path / "s.png")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| 2P2D cache_aware |" in out.stdout
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [r["label"] for r in rows] == ["2P2D round_robin", "2P2D cache_aware"]
    assert all(r["requests"] == 40 for r in rows)
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
