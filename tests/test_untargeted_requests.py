"""Requests that set no TTFT/ITL target are never throttled (issue 61): the decode node is told
to hold an ITL target only where the request or the operator (--itl-slo-ms) set one, while the
slo placement still prices where the prompt goes; and the KV pool's default size comes from the
machine's memory (pdserve.engine.kv_pool_size)."""
from __future__ import annotations

from pdserve import LLM
from pdserve.cluster.planner import DEFAULT_ITL_SLO_MS, DEFAULT_TTFT_SLO_MS, planner_targets_ms, target_flags
from pdserve.engine.kv_pool_size import (
    KV_POOL_CAP_GB,
    KV_POOL_FLOOR_GB,
    available_memory_bytes,
    default_kv_pool_gb,
    default_num_blocks,
)
from pdserve.entrypoints.cli import build_parser
from pdserve.protocol.block_keys import block_key_chain
from pdserve.protocol.tpot_budget import StepCosts
from pdserve.router.main import operator_targets
from pdserve.router.openai.schemas import CompletionRequest
from pdserve.router.placement.index import PrefixIndex
from pdserve.router.placement.keys import NO_SCOPE
from pdserve.router.placement.pd_decision import PRICING_TARGETS, Targets
from pdserve.router.placement.placement import Placement, PlacementRequest
from pdserve.router.placement.policy import NodeView, Planner

COSTS = StepCosts(0.010, 0.002, 0.0005)
GB = 2**30


def _placement(targets: Targets | None) -> Placement:
    planner = Planner(PrefixIndex(), 16, placement="slo", targets=targets)
    return Placement(planner, lambda prompt, scope: block_key_chain(prompt, 16, b"salt"))


def _place(placement: Placement, request_targets: Targets | None):
    decode = [NodeView("d0", 2, 100, 100, decode_rows=2, step_costs=COSTS)]
    prefill = [NodeView("p0", 0, prefill_s_per_token=COSTS.token_s)]
    request = PlacementRequest("r", list(range(400)), 64, None, request_targets, NO_SCOPE)
    return placement.place(request, decode, prefill)


def test_a_request_without_targets_is_held_to_none():
    decision = _place(_placement(None), None)
    assert decision.itl_target_s == 0.0  # the decode node caps nothing for it
    assert "placement" in decision.plan.scores  # the slo rule still chose where it prefills


def test_targets_act_where_the_request_or_the_operator_sets_them():
    assert _place(_placement(None), Targets(None, 0.05)).itl_target_s == 0.05
    assert _place(_placement(Targets(2.0, 0.08)), None).itl_target_s == 0.08
    assert _place(_placement(Targets(2.0, None)), None).itl_target_s == 0.0  # a TTFT target only
    assert _place(_placement(Targets(2.0, 0.08)), Targets(None, 0.03)).itl_target_s == 0.03


def test_a_body_target_fills_in_from_the_operator_only():
    body = CompletionRequest(prompt="x", ttft_slo_ms=500)
    assert body.targets(None) == Targets(0.5, None)
    assert body.targets(Targets(2.0, 0.1)) == Targets(0.5, 0.1)
    assert CompletionRequest(prompt="x").targets(Targets(2.0, 0.1)) is None
    assert Targets(None, 0.05).priced() == Targets(PRICING_TARGETS.ttft_s, 0.05)


def test_the_flags_default_to_no_targets():
    args = build_parser().parse_args(["up"])
    assert args.ttft_slo_ms is None and args.itl_slo_ms is None and args.kv_cache_memory_gb is None
    assert operator_targets(args) is None
    assert target_flags(args) == []  # `pdserve up` passes none on to its router
    assert planner_targets_ms(args) == (DEFAULT_TTFT_SLO_MS, DEFAULT_ITL_SLO_MS)  # what --planner sla holds
    args = build_parser().parse_args(["up", "--itl-slo-ms", "80"])
    assert operator_targets(args) == Targets(None, 0.08)
    assert target_flags(args) == ["--itl-slo-ms", "80.0"]


def test_default_kv_pool_is_a_share_of_the_available_memory():
    assert default_kv_pool_gb(2, available=24 * GB) == 0.6 * 24 / 2
    assert default_kv_pool_gb(1, available=GB // 2) == KV_POOL_FLOOR_GB
    assert default_kv_pool_gb(1, available=1024 * GB) == KV_POOL_CAP_GB
    assert default_kv_pool_gb(1, available=0) == KV_POOL_FLOOR_GB  # unreadable: the floor
    assert available_memory_bytes() > 0


def test_default_pool_holds_64_requests_of_2k_tokens_of_the_default_model():
    """SmolLM2-135M: 30 layers x (K, V) x 3 KV heads x 64 dims in float32, 16-token blocks; on a
    24 GiB machine with 21 GiB available (as here), in `pdserve up`'s two nodes."""
    block_bytes = 30 * 2 * 3 * 64 * 4 * 16
    blocks = default_num_blocks(block_bytes, 16, 128, 8192, nodes=2, available=21 * GB)
    assert blocks * 16 >= 64 * 2048
    # a tiny model never gets more blocks than its longest requests could fill at the batch's size
    assert default_num_blocks(1024, 16, 128, 512, nodes=1, available=21 * GB) == 128 * 512 // 16


def test_the_offline_llm_takes_the_nodes_default_pool():
    """LLM(...) with no pool size gets the same default as a node (it had a fixed 0.5 GB, which
    preempted 128 requests of a few hundred tokens on the default model): here the tiny model's
    cap, max_num_seqs requests of its full length (0.5 GB of its small blocks is more than that)."""
    llm = LLM("builtin:tiny")
    engine = llm.engine
    cap = engine.config.max_num_seqs * -(-engine.max_model_len // engine.config.block_size)
    assert engine.kv.pool.num_blocks == cap
    explicit = LLM("builtin:tiny", kv_cache_memory_gb=0.5).engine.kv.pool.num_blocks
    assert explicit != cap, "the tiny model's 0.5 GB must differ from the cap for this test to tell them apart"
