"""Adapter-aware routing without sockets: the router's per-node adapter state from pongs, the
cost it gives each node, the catch-up loads it sends, and the planner's choice. (The measured
loads avoided on a real cluster: benchmarks/serving/bench_lora_routing.py.)"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.router.dispatch.adapters import RouterAdapters
from pdserve.router.placement.index import PrefixIndex
from pdserve.router.placement.policy import NodeView, Planner
from pdserve.wire.messages import LoadLoRA, Pong


def _pong(loras, active) -> Pong:
    return Pong(0, "n", "decode", loras=list(loras), active_loras=list(active))


def _node(node_id: str):
    return SimpleNamespace(node_id=node_id)


def test_costs_follow_pongs_and_missing_adapters_are_sent_once():
    adapters = RouterAdapters({"a": "/ad/a", "b": "/ad/b", "c": "/ad/c"})
    d0, d1 = _node("d0"), _node("d1")
    sent = adapters.on_pong(d0, _pong(["a", "b"], ["a"]))
    assert [m.lora_name for m in sent] == ["c"] and sent[0].lora_path == "/ad/c"
    assert adapters.on_pong(d0, _pong(["a", "b"], ["a"])) == []  # not again until RESEND_AFTER_S
    adapters.on_pong(d1, _pong(["a", "b", "c"], ["b", "c"]))
    assert [adapters.cost("d0", n) for n in ("a", "b", "c", None)] == [0, 1, 2, 0]
    assert [adapters.cost("d1", n) for n in ("a", "b", "c")] == [1, 0, 0]
    assert adapters.cost("unknown-node", "a") == 2
    # a request on an adapter the node has not reported is preceded by its load
    assert isinstance(adapters.before_request(_node("d2"), "a"), LoadLoRA)
    assert adapters.before_request(d1, "a") is None and adapters.before_request(d1, None) is None


def test_begin_refuses_an_unloaded_adapter_and_counts_requests_in_flight():
    adapters = RouterAdapters({"a": "/ad/a"})
    assert adapters.begin("a") and adapters.begin(None)
    assert not adapters.begin("gone")
    assert adapters.in_flight["a"] == 1
    adapters.end("a")
    assert "a" not in adapters.in_flight


@pytest.mark.parametrize("policy", ["cache_aware", "least_loaded"])
def test_the_node_holding_the_adapter_is_chosen_unless_it_is_a_hot_spot(policy):
    planner = Planner(PrefixIndex(), 16, policy, policy)
    holder = NodeView("d1", in_flight=3, adapter_cost=0)
    others = [NodeView("d0", in_flight=0, adapter_cost=1), NodeView("d2", in_flight=0, adapter_cost=2)]
    for _ in range(4):  # every turn, despite d1 being the busier node
        assert planner.plan("r", 32, [], [others[0], holder, others[1]], []).decode == "d1"
    hot = NodeView("d1", in_flight=20, adapter_cost=0)
    assert planner.plan("r", 32, [], [others[0], hot], []).decode == "d0"
    prefill = [NodeView("p0", adapter_cost=2), NodeView("p1", adapter_cost=0)]
    assert planner.plan("r", 32, [], [holder], prefill).prefill == "p1"


def test_round_robin_ignores_adapters():
    planner = Planner(PrefixIndex(), 16, "round_robin", "round_robin")
    views = [NodeView("d0", adapter_cost=2), NodeView("d1", adapter_cost=0)]
    assert {planner.plan("r", 32, [], views, []).decode for _ in range(4)} == {"d0", "d1"}
