"""Async scheduling (overlapped decode steps) against the synchronous engine on the same model.

The overlap pays off only on a GPU, but its bookkeeping (pending tokens read on the device, a
request stopped one token late, length stops, preemption, aborts, mixed batches) is the same on
the CPU, where the engine runs it when asked: every output here must equal the synchronous
engine's, token for token and character for character, and no KV block may stay allocated.
"""
from __future__ import annotations

import random

import pytest

from pdserve.assembly.build import build_engine
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import PENDING_TOKEN
from pdserve.protocol.sampling_params import SamplingParams


def make_engine(async_scheduling: bool, num_kv_blocks: int = 256) -> LLMEngine:
    # float32 on every device: a preemption's recompute goes through the prefill kernels, and
    # bfloat16 roundings there may flip a near-tie that the decode kernels did not.
    return build_engine(EngineConfig(model="builtin:tiny", dtype="float32", num_kv_blocks=num_kv_blocks, max_num_seqs=16,
                                  max_num_batched_tokens=256, async_scheduling=async_scheduling))


def workload(seed: int = 0, n: int = 24, kinds: int = 6) -> list[tuple[list[int], SamplingParams]]:
    """kinds 0-3 are greedy without logprobs (every decode step overlaps); 4-5 are not."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 250) for _ in range(rng.randrange(4, 60))]
        kind = i % kinds
        if kind == 0:
            params = SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0, ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(max_tokens=40, temperature=0)  # the model's EOS may end it
        elif kind == 2:
            params = SamplingParams(max_tokens=40, temperature=0, stop=["e", "a "])
        elif kind == 3:
            params = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[rng.randrange(3, 250)
                                                                                 for _ in range(20)])
        elif kind == 4:  # a random draw in the batch: steps with it run synchronously
            params = SamplingParams(max_tokens=20, temperature=0.8, seed=i)
        else:
            params = SamplingParams(max_tokens=25, temperature=0, ignore_eos=True, logprobs=2)
        out.append((prompt, params))
    return out


def run(engine: LLMEngine, work, abort_after: dict[str, int] | None = None) -> dict:
    results: dict[str, dict] = {}
    for i, (prompt, params) in enumerate(work):
        engine.add_request(str(i), prompt, params)
        results[str(i)] = {"tokens": [], "text": "", "finish": None}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            r = results[out.request_id]
            r["tokens"] += out.new_token_ids
            r["text"] += out.new_text
            if out.finished:
                r["finish"] = out.finish_reason
        steps += 1
        for rid, at in (abort_after or {}).items():
            if steps == at:
                engine.abort_request(rid)
                results[rid]["finish"] = "abort"
        assert steps < 5000
    return results


def assert_no_blocks_held(engine: LLMEngine) -> None:
    assert engine.in_flight is None or not engine.in_flight.reqs
    assert engine.pool.num_free == engine.kv_cache.shape[0], "a KV block stayed allocated"


@pytest.mark.parametrize("kinds", [4, 6], ids=["greedy", "mixed"])
@pytest.mark.parametrize("num_kv_blocks", [256, 24], ids=["roomy", "preempting"])
def test_overlapped_steps_match_synchronous_steps(num_kv_blocks, kinds):
    work = workload(kinds=kinds)
    sync_engine, async_engine = make_engine(False, num_kv_blocks), make_engine(True, num_kv_blocks)
    expected = run(sync_engine, work)
    got = run(async_engine, work)
    assert got == expected
    assert all(r["finish"] in ("stop", "length") for r in got.values())
    assert {r["finish"] for r in got.values()} == {"stop", "length"}, "the workload must exercise both stops"
    if num_kv_blocks == 24:
        assert async_engine.scheduler.num_preemptions > 0, "the small cache must preempt"
    for engine in (sync_engine, async_engine):
        assert_no_blocks_held(engine)


def test_aborts_while_a_token_is_in_flight_free_every_block():
    work = [(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)) for p, _ in workload(1, 8)]
    engine = make_engine(True)
    got = run(engine, work, abort_after={"1": 3, "4": 6, "6": 10})
    expected = run(make_engine(False), work)
    for rid, r in got.items():
        if rid in ("1", "4", "6"):
            assert r["tokens"] == expected[rid]["tokens"][:len(r["tokens"])]
        else:
            assert r == expected[rid]
    assert_no_blocks_held(engine)


def test_a_pending_token_never_reaches_a_block_key_or_an_output():
    engine = make_engine(True)
    prompt = list(range(10, 42))  # two full blocks; the outputs fill more
    engine.add_request("a", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    seen_pending = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert PENDING_TOKEN not in out.new_token_ids
        req = engine.get_request("a")
        if req is not None and req.output_token_ids and req.output_token_ids[-1] == PENDING_TOKEN:
            seen_pending = True
            keys = engine.kv.block_keys(req)
            assert len(keys) == (req.num_tokens - 1) // engine.config.block_size
    assert seen_pending, "greedy decode steps must overlap"
    assert_no_blocks_held(engine)
