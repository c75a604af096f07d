"""A push-mode prompt awaiting its decode node's lent blocks (pdserve.node.borrowed_prefix), on a
real engine: a WriteTarget that lends less than the router said the decode node holds, or none
within the wait, leaves the request to compute its whole prompt, and its first token is a plain
engine's. (The lend that lands, READ over NIXL from a decode node in another process, is
tests/test_push_writes.py's next-turn test.)"""
from __future__ import annotations

import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.assembly.build import build_engine
from pdserve.engine.config import EngineConfig
from pdserve.engine.request import RequestStatus
from pdserve.node import borrowed_prefix
from pdserve.node.borrowed_prefix import BorrowedPrefix
from pdserve.node.node_stats import NodeStats
from pdserve.wire.handover import NixlMetadata
from pdserve.wire.messages import PrefillRequest, WriteTarget

PROMPT = [(i * 37) % 250 + 3 for i in range(100)]  # 6 whole blocks of 16 and a partial one
GREEDY = SamplingParams(max_tokens=1, temperature=0)


def test_a_lend_is_awaited_at_most_target_wait_s_and_at_least_a_round_trip(monkeypatch):
    engine = build_engine(EngineConfig(model="builtin:tiny", num_kv_blocks=64))
    borrowed = BorrowedPrefix(engine, None, NodeStats())
    monkeypatch.setattr(borrowed_prefix, "TARGET_WAIT_S", 0.3)
    for rid, per_token, wait_s in (("unmeasured", 0.0, 0.3), ("slow", 1.0, 0.3), ("fast", 1e-9, borrowed_prefix.MIN_WAIT_S)):
        engine.prefill_s_per_token = per_token
        req = engine.add_request(rid, PROMPT, GREEDY, hold_blocks=True, remote_kv_tokens=80)
        borrowed.await_target(req, 80)
        _, since, until = borrowed.waiting[rid]
        assert until - since == pytest.approx(wait_s)


def _first_token(engine) -> int:
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids:
                return out.new_token_ids[0]
    raise AssertionError("no token")


@pytest.mark.parametrize("how", ["lends_less", "never_comes"])
def test_a_lend_that_falls_short_or_never_comes_computes_the_prompt(how, monkeypatch):
    engine = build_engine(EngineConfig(model="builtin:tiny", num_kv_blocks=64))
    stats = NodeStats()
    borrowed = BorrowedPrefix(engine, None, stats)  # (no READ is posted on these paths)
    msg = PrefillRequest("a", PROMPT, GREEDY, "nixl", decode_holds_tokens=88, push=True, decode_lends=True)
    assert borrowed.tokens_to_borrow(msg, stored=0) == 80  # whole blocks only
    no_lend = PrefillRequest("b", PROMPT, GREEDY, "nixl", decode_holds_tokens=88, push=True)  # the router asked none
    assert borrowed.tokens_to_borrow(no_lend, stored=0) == 0
    req = engine.add_request("a", PROMPT, GREEDY, hold_blocks=True, remote_kv_tokens=80)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.prefill_s_per_token = 0.5e-3  # as measured on its steps: the 80 tokens compute in 40 ms
    monkeypatch.setattr(borrowed_prefix, "MIN_WAIT_S", 0.01)
    borrowed.await_target(req, 80)
    assert engine.step() == [] and req.num_computed_tokens == 0  # it waits for the lend
    if how == "lends_less":  # the decode node holds three blocks, not five
        target = WriteTarget("a", NixlMetadata("decode-0", b""), 3, [], 30.0, held_from=0, held=[(0, 1, 0)] * 3,
                             held_digests=[0] * 3)
        assert borrowed.take(target, "decode-0") is False
    else:  # it waits as long as computing the 80 tokens would take, not TARGET_WAIT_S
        borrowed.expire()
        assert borrowed.waiting, "computing them would take 40 ms: the lend is worth awaiting that long"
        time.sleep(0.06)
        borrowed.expire()
        assert stats.kv_borrow_wait_us >= 40_000
    assert not borrowed.waiting and stats.kv_borrow_failures == 1 and stats.kv_tokens_borrowed == 0
    want = LLM("builtin:tiny", num_kv_blocks=64).generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)
    assert _first_token(engine) == want[0].outputs[0].token_ids[0]
    assert engine.computed_prompt_tokens == len(PROMPT)
