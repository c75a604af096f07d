"""The per-request P/D decision (router.pd_decision, policy.Planner with placement "slo") and the
decode node's TPOT budget (engine.tpot_budget, the scheduler's prefill cap), without sockets.

Costs below are round numbers on the scale of the default model on one core: a decode step of
10 ms plus 2 ms per row, 0.5 ms per prompt token; targets TTFT 2 s, ITL 100 ms."""
from __future__ import annotations

import math

import pytest

from pdserve import LLM, SamplingParams
from pdserve.protocol.block_keys import block_key_chain
from pdserve.protocol.tpot_budget import (
    MIN_PREFILL_CHUNK,
    TARGET_SHARE,
    StepCostModel,
    StepCosts,
    StreamClock,
    absorbs_prefill,
    amortized_prefill_tokens,
    has_headroom,
    prefill_tokens_per_step,
)
from pdserve.router.openai.schemas import CompletionRequest
from pdserve.router.placement.costs import UNMEASURED_S_PER_TOKEN, CostModel
from pdserve.router.placement.index import PrefixIndex
from pdserve.router.placement.pd_decision import REMOTE_COMFORT, DecodeLoad, Targets, local_ttft_s, place, place_short
from pdserve.router.placement.policy import NodeView, Planner

COSTS = StepCosts(base_s=0.010, row_s=0.002, token_s=0.0005)
TARGETS = Targets(ttft_s=2.0, itl_s=0.100)


def test_budget_fills_the_step_up_to_the_target_share():
    chunk = prefill_tokens_per_step(4, COSTS, TARGETS.itl_s, 2048)
    assert COSTS.step_s(4, chunk) <= TARGETS.itl_s * TARGET_SHARE < COSTS.step_s(4, chunk + 1)
    assert prefill_tokens_per_step(0, COSTS, TARGETS.itl_s, 2048) == 2048  # no stream to hold
    assert prefill_tokens_per_step(4, COSTS, 0.0, 2048) == 2048  # no target
    # A node already past its target still prefills, a minimal chunk per step.
    assert prefill_tokens_per_step(60, COSTS, TARGETS.itl_s, 2048) == MIN_PREFILL_CHUNK
    assert has_headroom(4, COSTS, TARGETS.itl_s) and not has_headroom(33, COSTS, TARGETS.itl_s)


def test_idle_prefill_node_takes_the_prompt():
    load = DecodeLoad(rows=2, costs=COSTS)
    p = place(remote_ttft_s=400 * COSTS.token_s, local_tokens=400, load=load, targets=TARGETS)
    assert not p.local and p.reason == "prefill node within the TTFT target"


def test_long_prefill_queue_with_decode_headroom_goes_local():
    load = DecodeLoad(rows=2, costs=COSTS)
    remote = (6000 + 400) * COSTS.token_s  # 3.2 s behind a queue of 6000 tokens
    p = place(remote, 400, load, TARGETS)
    assert p.local and p.local_ttft_s < remote
    # The local estimate: chunks of what the target leaves after two rows, one step each.
    chunk = prefill_tokens_per_step(2, COSTS, TARGETS.itl_s, 2048)
    assert p.local_ttft_s == pytest.approx(math.ceil(400 / chunk) * COSTS.step_s(2, chunk))


def test_decode_near_its_tpot_target_keeps_the_prompt_remote():
    # 78 ms of decode per step: no room for 16 prompt tokens under 80 ms, room for one more stream (80 ms).
    busy = DecodeLoad(rows=34, costs=COSTS)
    p = place(remote_ttft_s=10.0, local_tokens=400, load=busy, targets=TARGETS)
    assert not p.local and p.reason == "decode steps at their ITL target with its prefill"


def test_queued_local_work_and_a_slow_decode_node_send_it_back_remote():
    remote = TARGETS.ttft_s * REMOTE_COMFORT + 0.3  # past the comfort share, but not by much
    queued = DecodeLoad(rows=2, costs=COSTS, queued_tokens=4000)  # the decode node is behind too
    p = place(remote, 400, queued, TARGETS)
    assert not p.local and p.local_ttft_s > remote and p.reason == "prefill node first"
    # The same queue on an idle decode node prefills in one unchunked go: local.
    idle = DecodeLoad(rows=0, costs=COSTS, queued_tokens=1000)
    assert local_ttft_s(400, idle, TARGETS.itl_s) == pytest.approx(COSTS.step_s(0, 1400))
    assert place(remote, 400, idle, TARGETS).local


def test_planner_places_per_request_only_under_slo_placement():
    index = PrefixIndex()
    keys = block_key_chain(list(range(400)), 16, b"salt")
    decode = [NodeView("d0", 2, 100, 100, decode_rows=2, step_costs=COSTS)]
    idle_prefill = [NodeView("p0", 0, prefill_s_per_token=COSTS.token_s)]
    queued_prefill = [NodeView("p0", 12, queued_tokens=6000, prefill_s_per_token=COSTS.token_s)]
    slo = Planner(index, 16, placement="slo", targets=TARGETS)
    assert slo.plan("a", 400, keys, decode, idle_prefill).prefill == "p0"
    plan = slo.plan("b", 400, keys, decode, queued_prefill)
    assert plan.prefill is None and plan.scores["placement"]["where"] == "local"
    # A request's own looser TTFT target keeps it on the prefill node.
    assert slo.plan("c", 400, keys, decode, queued_prefill, targets=Targets(10.0, 0.1)).prefill == "p0"
    # threshold placement (the default) never looks at load.
    assert Planner(index, 16, targets=TARGETS).plan("d", 400, keys, decode, queued_prefill).prefill == "p0"
    # Before the decode node has measured a prompt token, it is priced at the prefill nodes' cost.
    unmeasured = [NodeView("d0", 2, 100, 100, decode_rows=2, step_costs=StepCosts(0.010, 0.002, 0.0))]
    assert slo.plan("e", 400, keys, unmeasured, queued_prefill).prefill is None


def test_unmeasured_nodes_are_priced_from_their_peers_then_sent_the_first_prompts():
    """No node has measured a prompt token: the prefill node is within any TTFT target, so it gets
    the prompt (and measures itself on it); a guess of 1 s a token once sent every prompt local
    and the prefill node never measured. A prefill node with no measurement of its own, beside a
    decode node that has one, is priced at the decode node's cost: a long queue then sends the
    prompt local, as a measured one would."""
    index = PrefixIndex()
    keys = block_key_chain(list(range(400)), 16, b"salt")
    slo = Planner(index, 16, placement="slo", targets=TARGETS)
    fresh_decode = [NodeView("d0", 0, 100, 100, step_costs=StepCosts(0.010, 0.002, 0.0))]
    fresh_prefill = [NodeView("p0", 0)]
    assert slo.plan("a", 400, keys, fresh_decode, fresh_prefill).prefill == "p0"
    costs = CostModel(16)
    assert costs.fleet_cost(fresh_prefill) == UNMEASURED_S_PER_TOKEN
    measured_decode = NodeView("d0", 0, 100, 100, step_costs=COSTS)
    assert costs.fleet_cost(fresh_prefill, [measured_decode]) == COSTS.token_s
    queued_unmeasured = [NodeView("p0", 12, queued_tokens=6000)]
    plan = slo.plan("b", 400, keys, [measured_decode], queued_unmeasured)
    assert plan.prefill is None and plan.scores["placement"]["where"] == "local"
    # The same queue at the 1e-6 s a token of an unmeasured fleet is within the target: remote.
    assert slo.plan("c", 400, keys, fresh_decode, queued_unmeasured).prefill == "p0"


def test_step_cost_model_recovers_the_costs_it_is_fed():
    model = StepCostModel()
    for i in range(200):
        rows = 1 + i % 8
        model.observe(rows, 0, COSTS.step_s(rows, 0))
        if i % 4 == 0:
            model.observe(rows, 64, COSTS.step_s(rows, 64))
    fitted = model.costs()
    assert fitted.base_s == pytest.approx(COSTS.base_s, rel=0.05)
    assert fitted.row_s == pytest.approx(COSTS.row_s, rel=0.05)
    assert fitted.token_s == pytest.approx(COSTS.token_s, rel=0.05)


def test_step_cost_model_takes_no_first_step_of_a_kind_as_a_sample():
    """A node's first decode step and first prefilling step compile or load its kernels: a
    hundredfold step that the EMA would carry for dozens of steps."""
    model = StepCostModel()
    model.observe(4, 0, 100 * COSTS.step_s(4, 0))
    model.observe(4, 64, 100 * COSTS.step_s(4, 64))
    assert model.costs() == StepCosts()  # nothing measured yet
    for _ in range(3):
        model.observe(4, 0, COSTS.step_s(4, 0))
        model.observe(4, 64, COSTS.step_s(4, 64))
    assert model.costs().step_s(4, 0) == pytest.approx(COSTS.step_s(4, 0))
    assert model.costs().token_s == pytest.approx(COSTS.token_s)


def test_request_targets_from_the_body():
    body = CompletionRequest(prompt="x", ttft_slo_ms=500)
    assert body.targets(TARGETS) == Targets(0.5, TARGETS.itl_s)
    assert CompletionRequest(prompt="x").targets(TARGETS) is None  # the router's own apply
    with pytest.raises(ValueError):
        CompletionRequest(prompt="x", itl_slo_ms=0)


def test_capped_prefill_keeps_decode_rows_in_every_step_and_the_output_unchanged():
    """A decode stream and a long prompt on one engine: with a 16-token prefill cap beside decode
    rows, every step decodes the stream and prefills at most 16 prompt tokens, and both requests
    produce what the same engine uncapped (the reference) produces."""
    llm = LLM("builtin:tiny", num_kv_blocks=128, max_num_batched_tokens=256, enable_prefix_caching=False)
    engine = llm.engine
    short = ([(7 * i) % 200 + 20 for i in range(24)], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    long = ([(11 * i) % 200 + 20 for i in range(200)], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))

    def run(cap: bool, tag: str) -> tuple[dict, list]:
        engine.scheduler.prefill_budget = (lambda rows: 16 if rows else None) if cap else None
        engine.add_request(f"short{tag}", *short)
        for _ in range(3):  # the short one is decoding when the long one arrives
            engine.step()
        engine.add_request(f"long{tag}", *long)
        out, steps = {f"short{tag}": [], f"long{tag}": []}, []
        while engine.has_unfinished_requests():
            batch = engine.scheduler.schedule()
            steps.append({r.request_id[:-1]: n for r, n in batch.items})
            for o in engine.run_batch(batch):
                out[o.request_id] += o.new_token_ids
        return list(out.values()), steps

    capped, steps = run(True, "c")
    reference, ref_steps = run(False, "r")
    assert capped == reference and len(capped[1]) == 4
    beside = [s.get("long", 0) for s in steps if "short" in s]
    assert all(s["short"] == 1 for s in steps if "short" in s) and max(beside) == 16
    assert sum(n == 16 for n in beside) == 200 // 16  # the prompt went in in 16-token chunks
    assert max(s.get("long", 0) for s in ref_steps) == 200  # uncapped: in one step


def test_simulated_1p1d_overloaded_prefill_node_gains_from_placement():
    """The simulator (the router's real Planner against modelled nodes): long prompts arrive faster
    than one prefill node computes them while the decode node idles. Per-request placement sends
    the overflow to the decode node and more requests meet both targets; streams that decode
    beside a local prefill keep their mean inter-token time within the ITL target."""
    from pdserve.sim.costs import NodeCosts
    from pdserve.sim.elastic import Phase, attainment, phase_trace
    from pdserve.sim.simulator import ClusterSpec, Simulator

    costs, slo = NodeCosts(), Targets(1.0, 0.03)
    trace = phase_trace([Phase(20.0, 5.0, 2048, 4), Phase(20.0, 5.0, 64, 64)], seed=1)
    done = {}
    for placement in ("threshold", "slo"):
        spec = ClusterSpec(1, 1, kv_blocks=4096, placement=placement, targets=slo)
        done[placement] = Simulator(spec, costs, trace).run()
        assert len(done[placement]) == len(trace)
    got = {p: attainment(d, slo.ttft_s, slo.itl_s) for p, d in done.items()}
    assert got["slo"] > got["threshold"] + 0.2, got
    local = [r for r in done["slo"] if r.prefill_node is None]
    assert 0 < len(local) < len(trace)
    decoding = [r for r in done["slo"] if r.output_tokens > 4]
    assert max((r.finish - r.first_token) / (r.output_tokens - 1) for r in decoding) <= slo.itl_s


def test_prompts_queued_on_the_decode_node_count_as_its_rows():
    """node_view: every request the router has on a decode node is a row by the time a prompt
    queued after it prefills, so a node whose queued local prompts leave no headroom under the ITL
    target is not handed another one (a decode node with slow steps does not take every prompt)."""
    from pdserve.router.dispatch.node_view import node_view
    from pdserve.router.dispatch.nodes import Node

    node = Node("d0", "decode", "tcp://127.0.0.1:1", sock=None, healthy=True,
                stats={"free_blocks": 100, "total_blocks": 100, "step_base_us": 10_000, "decode_row_us": 40_000,
                       "mixed_prefill_ns_per_token": 500_000})
    node.requests = {"a", "b"}
    node.queued_tokens = {"a": 300, "b": 300}  # both still prefilling there
    view = node_view(node)
    assert view.decode_rows == 2 and view.queued_tokens == 600
    index = PrefixIndex()
    keys = block_key_chain(list(range(400)), 16, b"salt")
    queued_prefill = [NodeView("p0", 12, queued_tokens=6000, prefill_s_per_token=COSTS.token_s)]
    plan = Planner(index, 16, placement="slo", targets=TARGETS).plan("x", 400, keys, [view], queued_prefill)
    assert plan.prefill == "p0" and plan.scores["placement"]["reason"] == "decode steps at their ITL target"


def test_push_mode_requests_waiting_on_a_decode_node_are_not_its_rows():
    """A push-mode request is on its decode node from its arrival, waiting for a prompt another
    node computes: node_view does not count it as a decode row (pull mode's would not be there
    at all), so it does not make the decode node look too busy to prefill a prompt itself."""
    from pdserve.router.dispatch.node_view import node_view
    from pdserve.router.dispatch.nodes import Node

    node = Node("d0", "decode", "tcp://127.0.0.1:1", sock=None, healthy=True,
                stats={"free_blocks": 100, "total_blocks": 100, "step_base_us": 10_000, "decode_row_us": 40_000,
                       "mixed_prefill_ns_per_token": 500_000})
    node.requests = {"a", "b", "c"}
    node.pushed = {"b", "c", "gone"}  # (one that ended before its KVReady: no longer a request there)
    view = node_view(node)
    assert view.decode_rows == 1 and view.in_flight == 1
    node.pushed.clear()  # their KVReady went: they decode there now
    assert node_view(node).decode_rows == 3


def test_decode_at_its_target_sends_the_request_whole_to_an_idle_prefill_node():
    """The monolithic fallback (rule 2): the decode node has no room beside its streams, so a
    prefill node that serves whole requests, where a stream would decode faster (fewer streams,
    little prefill queued), prefills and decodes it. A busy prefill node (its queue's prefill
    would slow the stream more), one with as many streams, or one that does not serve whole
    requests: remote."""
    busy = DecodeLoad(rows=35, costs=COSTS)  # one more stream: 82 ms a step, past the 80 ms share
    for host in (DecodeLoad(rows=0, costs=COSTS), DecodeLoad(rows=30, costs=COSTS, queued_tokens=100)):
        p = place(remote_ttft_s=0.2, local_tokens=400, load=busy, targets=TARGETS, whole=host)
        assert p.whole and not p.local and p.scores()["where"] == "whole"
    # 1000 queued tokens: 0.5 s of prefill over a 32-token stream's 31 intervals, 16 ms more a token.
    queued_host = DecodeLoad(rows=30, costs=COSTS, queued_tokens=1000)
    for whole in (None, queued_host, DecodeLoad(rows=35, costs=COSTS)):
        p = place(remote_ttft_s=0.2, local_tokens=400, load=busy, targets=TARGETS, whole=whole)
        assert not p.whole and not p.local and p.reason == "decode steps at their ITL target"
    # A decode node with room keeps the stream: the fallback is for a decode-bound node.
    assert not place(0.2, 400, DecodeLoad(rows=2, costs=COSTS), TARGETS, whole=DecodeLoad(0, COSTS)).whole


def test_decode_node_with_room_for_the_stream_but_not_its_prefill_takes_it_remote():
    """Rule 2's first branch: 20 streams leave room for a 21st (52 ms a step, under the 80 ms
    share) but not for a 4000-token prefill beside them, so the prompt prefills remotely and the
    stream decodes there, even though an idle prefill node would decode it faster whole. At 34
    streams plus queued prompts spread over the stream, the node is full: whole again."""
    roomy = DecodeLoad(rows=20, costs=COSTS)
    p = place(remote_ttft_s=0.2, local_tokens=4000, load=roomy, targets=TARGETS, whole=DecodeLoad(0, COSTS),
              stream_tokens=32)
    assert not p.local and not p.whole and p.reason == "decode steps at their ITL target with its prefill"
    queued = DecodeLoad(rows=34, costs=COSTS, queued_tokens=200)  # 80 ms + 200 x 0.5 ms / 31 > 80 ms
    assert place(0.2, 4000, queued, TARGETS, whole=DecodeLoad(0, COSTS), stream_tokens=32).whole


def test_planner_runs_the_request_whole_on_the_prefill_node_and_prices_its_streams():
    """Planner: the whole placement names the prefill node as the decode node, with no prefill
    node; a prefill node that does not serve whole requests is never chosen so. A prefill node
    that decodes streams prefills in capped chunks, and its TTFT estimate says so."""
    index = PrefixIndex()
    keys = block_key_chain(list(range(400)), 16, b"salt")
    busy = [NodeView("d0", 35, 100, 100, decode_rows=35, step_costs=COSTS)]
    slo = Planner(index, 16, placement="slo", targets=TARGETS)
    host = NodeView("p0", 0, prefill_s_per_token=COSTS.token_s, step_costs=COSTS, takes_whole=True)
    plan = slo.plan("a", 400, keys, busy, [host])
    assert (plan.decode, plan.prefill) == ("p0", None) and plan.scores["placement"]["where"] == "whole"
    plain = NodeView("p0", 0, prefill_s_per_token=COSTS.token_s, step_costs=COSTS)
    assert slo.plan("b", 400, keys, busy, [plain]).prefill == "p0"
    # Four streams on the prefill node: 400 tokens take ceil(400 / chunk) capped steps, not 0.2 s.
    streaming = NodeView("p0", 4, prefill_s_per_token=COSTS.token_s, step_costs=COSTS, decode_rows=4)
    idle_decode = [NodeView("d0", 0, 100, 100, step_costs=COSTS)]
    remote = slo.plan("c", 400, keys, idle_decode, [streaming]).scores["placement"]["remote_ttft"]
    chunk = prefill_tokens_per_step(4, COSTS, TARGETS.itl_s, 2048)
    assert remote == pytest.approx(math.ceil(400 / chunk) * COSTS.step_s(4, chunk), abs=1e-4)


def test_prefill_node_view_counts_its_whole_requests_as_rows():
    from pdserve.router.dispatch.node_view import node_view
    from pdserve.router.dispatch.nodes import Node

    node = Node("p0", "prefill", "tcp://127.0.0.1:1", sock=None, healthy=True, stats={"serves_whole": 1})
    node.requests = {"a", "b", "c"}  # two prompts it prefills for others, one whole request
    node.whole = {"c"}
    view = node_view(node)
    assert view.decode_rows == 1 and view.takes_whole


def test_a_prefill_stall_spreads_over_the_streams_tokens():
    """TPOT is a stream's mean: a decode node whose every step with a prefill chunk would pass the
    target still has room for a short prompt when its stall, spread over a stream's tokens, keeps
    the mean within the target share; a long prompt, or short streams, do not fit."""
    slow_token = StepCosts(base_s=0.035, row_s=0.007, token_s=0.0032)  # the default model on one core
    rows4 = DecodeLoad(rows=4, costs=slow_token)
    assert not has_headroom(4, slow_token, TARGETS.itl_s)  # 16 tokens alone take 51 ms
    # 35 + 5 x 7 = 70 ms a step; 64 tokens: 205 ms over 31 intervals, 6.6 ms: 76.6 ms <= 80 ms.
    assert place(3.0, 64, rows4, TARGETS, stream_tokens=32).local
    assert absorbs_prefill(4, slow_token, TARGETS.itl_s, 64, 32)
    assert not absorbs_prefill(4, slow_token, TARGETS.itl_s, 512, 32)  # 1.6 s / 31 = 53 ms more
    assert not absorbs_prefill(4, slow_token, TARGETS.itl_s, 64, 8)  # 205 ms over 7 intervals
    assert not place(3.0, 64, rows4, TARGETS, stream_tokens=8).local
    assert absorbs_prefill(4, slow_token, TARGETS.itl_s, 64, 0) == has_headroom(4, slow_token, TARGETS.itl_s)


def test_stream_clocks_let_a_step_prefill_what_the_streams_banked_and_will_bank():
    """The node's budget (tpot_budget.amortized_prefill_tokens): a stream 100 ms ahead of its
    target share, with 20 tokens left at 20 ms below the share each, absorbs 500 ms of prefill:
    1000 tokens at 0.5 ms. The least allowance among the streams decides; a stream behind its
    target and with nothing left to bank still lets a minimal chunk through; no stream, no cap."""
    now = 10.0
    share = TARGETS.itl_s * TARGET_SHARE  # 80 ms
    # 10 tokens in 0.7 s: 100 ms banked. Steps of 60 ms (10 + 25 rows x 2 ms) bank 20 ms a token.
    ahead = StreamClock(TARGETS.itl_s, start_s=now - 0.7, tokens_left=30, tokens=10)
    assert ahead.allowance_s(now, COSTS.step_s(25, 0)) == pytest.approx(0.1 + 20 * (share - 0.060))
    assert amortized_prefill_tokens([ahead], now, 25, COSTS, 2048) == 1000
    behind = StreamClock(TARGETS.itl_s, start_s=now - 2.0, tokens_left=10, tokens=10)  # 1.2 s late, done banking
    assert amortized_prefill_tokens([ahead, behind], now, 25, COSTS, 2048) == MIN_PREFILL_CHUNK
    assert amortized_prefill_tokens([], now, 25, COSTS, 2048) == 2048
    assert amortized_prefill_tokens([ahead], now, 25, COSTS, 512) == 512  # never past the step's budget


def test_the_decode_node_s_reported_slack_must_pay_for_a_local_prefill():
    """The model says a 64-token prompt fits beside four streams (as in the stall test above), but
    the node reports its streams can absorb only 50 ms more: the 205 ms prefill goes remote. The
    node view reads the slack from the pong, and a node without timed streams has no limit."""
    from pdserve.router.dispatch.node_view import node_view
    from pdserve.router.dispatch.nodes import Node

    slow_token = StepCosts(base_s=0.035, row_s=0.007, token_s=0.0032)
    roomy = DecodeLoad(rows=4, costs=slow_token)
    assert place(3.0, 64, roomy, TARGETS, stream_tokens=32).local
    tight = DecodeLoad(rows=4, costs=slow_token, slack_s=0.050)
    p = place(3.0, 64, tight, TARGETS, stream_tokens=32)
    assert not p.local and p.reason == "decode steps at their ITL target with its prefill"
    node = Node("d0", "decode", "tcp://127.0.0.1:1", sock=None, healthy=True, stats={"stream_slack_us": -20_000})
    assert node_view(node).stream_slack_s == pytest.approx(-0.02)
    assert node_view(Node("d1", "decode", "tcp://127.0.0.1:1", sock=None, healthy=True)).stream_slack_s == math.inf


def test_a_decode_node_whose_streams_are_past_their_share_takes_no_more():
    """The node's word beats the model: 10 streams price at 32 ms a step, well under the 80 ms
    share, but the node reports a stream already behind its share (negative slack). The stream
    then runs whole on an idle prefill node; with slack left, it decodes remotely as before."""
    behind = DecodeLoad(rows=10, costs=COSTS, slack_s=-0.010)
    p = place(remote_ttft_s=0.2, local_tokens=400, load=behind, targets=TARGETS, whole=DecodeLoad(0, COSTS),
              stream_tokens=32)
    assert p.whole and p.reason == "decode node full: whole on the prefill node"
    on_pace = DecodeLoad(rows=10, costs=COSTS, slack_s=0.5)
    p = place(0.2, 4000, on_pace, TARGETS, whole=DecodeLoad(0, COSTS), stream_tokens=32)
    assert not p.whole and not p.local
    # A prefill node whose own streams are behind is no better a host: remote, whatever the queue.
    p = place(0.2, 400, behind, TARGETS, whole=DecodeLoad(12, COSTS, slack_s=-0.010), stream_tokens=32)
    assert not p.whole and not p.local


def test_a_cached_prompt_on_a_full_decode_node_runs_whole_on_the_prefill_node():
    """Rule 1's case (place_short): the decode node holds all but 64 tokens of the prompt, so no
    prefill node is worth a round trip, but one more stream would take its steps past the 80 ms
    share (35 streams). An idle prefill node serving whole requests takes it whole; a decode node
    with room, no such node, or one whose TTFT estimate is past the comfort share: local."""
    busy = DecodeLoad(rows=35, costs=COSTS)
    idle = DecodeLoad(rows=0, costs=COSTS)
    p = place_short(64, busy, TARGETS, idle, whole_ttft_s=0.25, stream_tokens=32)
    assert p.whole and not p.local and p.where() == "whole"
    assert place_short(64, DecodeLoad(rows=3, costs=COSTS), TARGETS, idle, 0.25, 32).local
    assert place_short(64, busy, TARGETS, None, 0.25, 32).local
    assert place_short(64, busy, TARGETS, idle, TARGETS.ttft_s * REMOTE_COMFORT + 0.01, 32).local
    # A host as full as the decode node holds the stream no better.
    assert place_short(64, busy, TARGETS, DecodeLoad(rows=36, costs=COSTS), 0.25, 32).local


def test_planner_sends_a_cached_prompt_whole_when_its_decode_node_is_full():
    """Planner: the decode node holds the prompt's 384-token prefix (the shared-prefix workload),
    so the threshold rule keeps it local; under slo placement a full decode node hands it whole
    to the prefill node, which is priced for the tokens it must compute itself. A decode node
    with room keeps it, and threshold placement never looks."""
    index = PrefixIndex()
    keys = block_key_chain(list(range(448)), 16, b"salt")
    index.add("d0", keys[:24])
    host = [NodeView("p0", 0, prefill_s_per_token=COSTS.token_s, step_costs=COSTS, takes_whole=True)]
    full = [NodeView("d0", 35, 100, 100, decode_rows=35, step_costs=COSTS)]
    slo = Planner(index, 16, placement="slo", targets=TARGETS, local_prefill_threshold=128)
    plan = slo.plan("a", 448, keys, full, host, max_tokens=32)
    assert (plan.decode, plan.prefill, plan.decode_cached_tokens) == ("p0", None, 0)
    assert plan.scores["placement"]["where"] == "whole"
    assert plan.scores["placement"]["remote_ttft"] == pytest.approx(448 * COSTS.token_s, abs=1e-4)
    roomy = [NodeView("d0", 3, 100, 100, decode_rows=3, step_costs=COSTS)]
    plan = slo.plan("b", 448, keys, roomy, host, max_tokens=32)
    assert (plan.decode, plan.prefill, plan.decode_cached_tokens) == ("d0", None, 384)
    threshold = Planner(index, 16, targets=TARGETS, local_prefill_threshold=128)
    assert threshold.plan("c", 448, keys, full, host, max_tokens=32).decode == "d0"
