"""Engine core behaviour on the built-in model: block keys, the block pool, remote-KV admission,
aborts, and the incremental step API."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import RequestStatus
from pdserve.protocol.block_keys import block_key_chain, kv_layout_salt

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny", num_kv_blocks=64, max_num_batched_tokens=256)


def test_block_keys_are_identical_across_processes():
    salt = kv_layout_salt("m", 2, 2, 64, "float32", 16)
    tokens = list(range(1000, 1050))
    here = [k.hex() for k in block_key_chain(tokens, 16, salt)]
    code = ("from pdserve.protocol.block_keys import *; s = kv_layout_salt('m', 2, 2, 64, 'float32', 16);"
            "print(','.join(k.hex() for k in block_key_chain(list(range(1000, 1050)), 16, s)))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    there = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert there.stdout.strip().split(",") == here and len(here) == 3


def test_block_keys_chain_and_salt():
    salt = kv_layout_salt("m", 2, 2, 64, "float32", 16)
    tokens = list(range(64))
    keys = block_key_chain(tokens, 16, salt)
    changed = block_key_chain([999] + tokens[1:], 16, salt)
    assert all(a != b for a, b in zip(keys, changed)), "a change in block 0 must change every later key"
    assert block_key_chain(tokens, 16, kv_layout_salt("other", 2, 2, 64, "float32", 16))[0] != keys[0]
    with_partial = block_key_chain(tokens + [1, 2], 16, salt, include_partial=True)
    assert with_partial[:4] == keys and len(with_partial) == 5


def test_block_pool_lru_eviction_and_reuse():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"key-a")
    pool.cache_block(b, b"key-b")
    pool.free([b, a])  # tail first: b is evicted before a
    assert pool.lookup(b"key-a") == a and pool.num_free == 4
    pool.touch([a])  # a prefix hit takes the block back out of the free queue
    assert pool.num_free == 3 and pool.blocks[a].ref_cnt == 1
    fresh = pool.allocate(3)  # the two never-used blocks, then b (least recently freed)
    assert b in fresh and pool.lookup(b"key-b") is None and pool.lookup(b"key-a") == a
    with pytest.raises(MemoryError):
        pool.allocate(1)


def test_prefix_reuse_across_requests(llm):
    prompt = list(range(40, 120))
    first = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": prompt + [5, 6]}, GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens == 80 and first.num_cached_tokens == 0
    assert llm.engine.pool.num_in_use() == 0


def test_generated_tokens_and_landed_kv_enter_the_prefix_cache(llm):
    """A follow-up turn resends prompt + answer: every full block of both is a cache hit, on the
    node that decoded the answer, whether the prompt was computed there or its KV landed."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompt = list(range(60, 110))  # 50 tokens; with the answer, 90 tokens = 5 full blocks
    answer = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    follow = llm.generate({"prompt_token_ids": prompt + answer + [7, 8]}, GREEDY, use_tqdm=False)[0]
    assert follow.num_cached_tokens == (len(prompt) + len(answer) - 1) // 16 * 16 == 80
    receiver = LLM("builtin:tiny", num_kv_blocks=32).engine
    first, blocks = _prefill_elsewhere(llm, prompt)
    req = receiver.add_request("r", prompt, GREEDY, output_token_ids=[first], remote_kv_tokens=len(prompt))
    receiver.kv_cache[req.block_ids] = blocks
    receiver.report_remote_kv("r", ok=True)
    _drain(receiver, "r")
    again = receiver.add_request("again", prompt + [1], GREEDY)
    receiver.step()
    assert again.num_cached_tokens == 48


def _prefill_elsewhere(llm, prompt):
    """Runs the prompt on `llm` until its first token; returns (first token, KV blocks)."""
    engine = llm.engine
    engine.add_request("donor", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while not (outs := engine.step()):
        pass
    req = engine.get_request("donor")
    blocks = engine.kv_cache[req.block_ids].clone()
    engine.abort_request("donor")
    return outs[0].new_token_ids[0], blocks


def test_remote_kv_landing_resumes_from_landed_prefix(llm):
    prompt = list(range(10, 60))  # 50 tokens: 3 full blocks and a partial one
    want = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    receiver = LLM("builtin:tiny", num_kv_blocks=32, enable_prefix_caching=False)
    first, blocks = _prefill_elsewhere(llm, prompt)
    engine = receiver.engine
    req = engine.add_request("r", prompt, GREEDY, output_token_ids=[first], remote_kv_tokens=len(prompt))
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and len(req.block_ids) == 4
    engine.add_request("other", [1, 2, 3], GREEDY)
    for _ in range(3):  # held: takes no budget while the other request runs
        engine.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req.num_output_tokens == 1
    engine.kv_cache[req.block_ids] = blocks
    engine.report_remote_kv("r", ok=True)
    got = [t for out in engine.step() if out.request_id == "r" for t in out.new_token_ids]
    assert req.num_computed_tokens == len(prompt) + 1, "the landed prompt must not be recomputed"
    got += _drain(engine, "r")
    assert req.num_cached_tokens == 0, "landed KV is not a local prefix-cache hit"
    assert engine.scheduler.num_preemptions == 0
    assert [first] + got == want
    assert engine.pool.num_in_use() == 0


def test_remote_kv_deadline_and_failure_fall_back_to_local_compute(llm):
    prompt = list(range(70, 110))
    want = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    receiver = LLM("builtin:tiny", num_kv_blocks=32, remote_kv_timeout_s=0.3)
    engine = receiver.engine
    engine.add_request("late", prompt, GREEDY, output_token_ids=want[:1], remote_kv_tokens=len(prompt))
    engine.add_request("failed", prompt, GREEDY, output_token_ids=want[:1], remote_kv_tokens=len(prompt))
    engine.report_remote_kv("failed", ok=False)  # blocks hold garbage: they must be recomputed
    pinned = engine.add_request("pinned", prompt, GREEDY, output_token_ids=want[:1], remote_kv_tokens=len(prompt))
    engine.mark_remote_transfer("pinned")  # a transfer still writes into its blocks
    assert want[:1] + _drain_until(engine, "late") == want
    time.sleep(0.35)
    engine.step()
    assert pinned.status == RequestStatus.WAITING_FOR_REMOTE_KVS, "past its deadline, but the transfer is live"
    engine.report_remote_kv("pinned", ok=False)
    assert want[:1] + _drain(engine, "pinned") == want
    assert engine.pool.num_in_use() == 0


def test_a_step_has_work_ready_only_once_a_remote_waits_is_over(llm):
    """has_work_ready (the core board's hint: a step with nothing ready leaves its node idle, its
    core lent) is false while every request waits for its KV, and true once the KV landed, the
    transfer failed, or its deadline passed, as the step then computes."""
    receiver = LLM("builtin:tiny", num_kv_blocks=32, remote_kv_timeout_s=0.3).engine
    sched = receiver.scheduler
    assert not sched.has_work_ready()
    receiver.add_request("landing", list(range(10, 60)), GREEDY, output_token_ids=[3], remote_kv_tokens=50)
    receiver.add_request("failing", list(range(70, 110)), GREEDY, output_token_ids=[3], remote_kv_tokens=40)
    receiver.step()
    assert not sched.has_work_ready() and receiver.last_step_tokens == 0
    receiver.report_remote_kv("landing", ok=True)
    assert sched.has_work_ready()
    receiver.step()
    receiver.abort_request("landing")
    assert not sched.has_work_ready()
    time.sleep(0.35)  # "failing" is past its deadline: it computes its prompt
    assert sched.has_work_ready()
    receiver.add_request("local", [1, 2, 3], GREEDY)
    assert sched.has_work_ready()


def _drain_until(engine, request_id: str) -> list[int]:
    """Step until request_id finishes (others may still be pending)."""
    tokens: list[int] = []
    while engine.get_request(request_id) is not None:
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
    return tokens


def _drain(engine, request_id: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
    return tokens


def test_abort_frees_blocks_in_every_state():
    llm = LLM("builtin:tiny", num_kv_blocks=12, max_num_batched_tokens=32)
    engine = llm.engine
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    engine.add_request("remote", list(range(30)), params, output_token_ids=[1], remote_kv_tokens=30)
    for i in range(4):
        engine.add_request(f"r{i}", list(range(i, i + 40)), params)
    states = set()
    for _ in range(40):
        engine.step()
        states |= {r.status for r in engine.scheduler.requests.values()}
    assert {RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.RUNNING} <= states
    assert engine.pool.num_in_use() > 0
    for rid in ["remote"] + [f"r{i}" for i in range(4)]:
        engine.abort_request(rid)
    assert engine.pool.num_in_use() == 0 and not engine.has_unfinished_requests()
    assert engine.scheduler.num_preemptions > 0


def test_step_api_streams_tokens_and_text(llm):
    engine = llm.engine
    tok = llm.get_tokenizer()
    prompt = tok("stream me")["input_ids"]
    engine.add_request("s", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert [len(d.new_token_ids) for d in deltas] == [1] * 6 and deltas[-1].finished
    ids = [t for d in deltas for t in d.new_token_ids]
    assert "".join(d.new_text for d in deltas) == tok.decode(ids, skip_special_tokens=True)
    assert deltas[-1].finish_reason == "length"


def test_bad_requests_are_rejected(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.engine.add_request("e", [], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        llm.engine.add_request("v", [10**6], GREEDY)
    with pytest.raises(ValueError, match="at most"):
        llm.engine.add_request("l", [1] * 5000, GREEDY)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


def test_concurrent_requests_compute_a_shared_prefix_once():
    """Requests that arrive together with a prefix nobody holds yet: the first computes it, the
    others wait for its blocks and take them from the prefix cache; outputs stay exact."""
    shared = [(i * 37) % 200 + 20 for i in range(256)]
    prompts = [shared + [30 + k] * 5 for k in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # The token budget fits all three prompts into one step: without waiting, each would compute
    # the prefix itself.
    together = LLM("builtin:tiny", max_num_batched_tokens=2048)
    outs = together.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine = together.engine
    assert engine.computed_prompt_tokens == 256 + 3 * 5  # the prefix once, each tail once
    assert [o.num_cached_tokens for o in outs] == [0, 256, 256]
    alone = LLM("builtin:tiny", enable_prefix_caching=False)
    for prompt, out in zip(prompts, outs):
        ref = alone.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert engine.pool.num_used == 0


def test_the_prefill_cost_estimate_skips_the_first_prefill_step():
    """The routers' TTFT estimate per prefill node (its pong's prefill_ns_per_token) is no sample
    of the first prefill-sized step, which pays the kernels' one-time costs; the next is one."""
    llm = LLM("builtin:tiny", num_kv_blocks=64, max_num_batched_tokens=256)
    engine = llm.engine
    prompts = [[3 + (7 * i + k) % 200 for i in range(100)] for k in range(2)]
    engine.add_request("first", prompts[0], GREEDY)
    engine.step()
    assert engine.prefill_s_per_token == 0.0
    engine.add_request("second", prompts[1], GREEDY)
    engine.step()
    assert engine.prefill_s_per_token > 0.0
