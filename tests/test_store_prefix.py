"""A prompt computed away from the node its prefix was handed over from loads the prefix the shared
store holds instead of recomputing it: a decode node's own prefill (and a prefill node's whole
request) as a prefill node's handover always did. The router counts that prefix as the decode
node's when it decides where the prompt is prefilled, and prices its load."""
from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.kvstore.factory import make_store
from pdserve.node.node_stats import NodeStats
from pdserve.node.store_prefix import LOOKUP_TIMEOUT_S, StorePrefix
from pdserve.protocol.block_keys import block_key_chain
from pdserve.protocol.tpot_budget import StepCosts
from pdserve.router.placement.index import STORE_HOLDER, PrefixIndex
from pdserve.router.placement.pd_decision import Targets
from pdserve.router.placement.policy import NodeView, Planner
from pdserve.testing.redis_server import redis_server
from pdserve.testing.up_cluster import node_stats, running_cluster, wait_for

# 328 + 48 tokens: the two prompts share their first 20 full blocks (320 tokens).
PROMPTS = ["Every node reads the stored prefix once. " * 8 + f"{who} question, asked of the stored prefix here."
           for who in ("First", "Other")]
MAX_TOKENS = 12
COSTS = StepCosts(base_s=0.010, row_s=0.002, token_s=0.0005)


def _planner_inputs() -> tuple[PrefixIndex, list[bytes], list[NodeView]]:
    index = PrefixIndex()
    keys = block_key_chain(list(range(400)), 16, b"salt")
    index.add(STORE_HOLDER, keys[:24])  # 384 of the 400 tokens are in the store
    return index, keys, [NodeView("p0", 0, prefill_s_per_token=COSTS.token_s)]


def test_the_planner_counts_the_stored_prefix_for_a_decode_node_that_reads_the_store():
    index, keys, prefill = _planner_inputs()
    reader = NodeView("d0", 0, 100, 100, step_costs=COSTS, reads_store=True)
    no_store = NodeView("d0", 0, 100, 100, step_costs=COSTS)
    threshold = Planner(index, 16, local_prefill_threshold=128)
    assert threshold.plan("a", 400, keys, [reader], prefill).prefill is None, "16 tokens to compute: local"
    assert threshold.plan("b", 400, keys, [no_store], prefill).prefill == "p0", "400 tokens to compute: remote"


def test_the_local_estimate_prices_the_store_load():
    index, keys, prefill = _planner_inputs()
    slo = Planner(index, 16, placement="slo", targets=Targets(2.0, 0.1))
    measured = NodeView("d0", 0, 100, 100, step_costs=COSTS, store_s_per_token=1e-4, reads_store=True)
    local = slo.plan("a", 400, keys, [measured], prefill).scores["placement"]["local_ttft"]
    no_store = NodeView("d0", 0, 100, 100, step_costs=COSTS)
    recompute = slo.plan("b", 400, keys, [no_store], prefill).scores["placement"]["local_ttft"]
    load_s = 384 * 1e-4
    assert local == pytest.approx(COSTS.step_s(0, 16) + load_s, abs=1e-4)
    assert recompute == pytest.approx(COSTS.step_s(0, 400), abs=1e-4)


@pytest.fixture(scope="module")
def reference():
    llm = LLM("builtin:tiny", num_kv_blocks=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False))}


def _complete(client: openai.OpenAI, prompt: str):
    return client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})


def test_a_decode_node_prefilling_a_prompt_loads_its_prefix_from_the_store(reference):
    """The first prompt goes through the prefill node, whose handover puts its blocks in Redis
    and is pulled by decode-0. The second shares 20 blocks with it: round-robin sends it to
    decode-1, which lacks only 56 tokens counting the store, so it prefills the prompt itself
    and loads the 20 blocks from Redis (before, it computed all 376 tokens)."""
    flags = ("--prefill-nodes", "1", "--decode-nodes", "2", "--kv-transfer", "store", "--num-kv-blocks", "256",
             "--local-prefill-threshold", "128", "--decode-policy", "round_robin")
    with running_cluster(*flags) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        first = _complete(client, PROMPTS[0])
        assert first.choices[0].text == reference[PROMPTS[0]]
        wait_for(lambda: node_stats(url)["prefill-0"]["transfer_bytes_store"] > 0)
        second = _complete(client, PROMPTS[1])
        assert second.choices[0].text == reference[PROMPTS[1]]
        assert second.usage.prompt_tokens_details.cached_tokens == 320
        # Node stats come with pongs (every 0.2 s): wait for one from after the load.
        stats = wait_for(lambda: (s := node_stats(url)) and s["decode-1"]["cached_tokens_store"] == 320 and s)
        assert stats["decode-1"]["requests_total"] == 1
        assert stats["prefill-0"]["requests_total"] == 1, "the second prompt was prefilled on its decode node"
        assert stats["decode-1"]["prefills_local"] == 1


def test_a_prompt_a_decode_node_computed_is_written_to_the_store(reference):
    """No prefill node: a decode node computes the first prompt and writes its full blocks to
    Redis (off its steps); round-robin sends the second, which shares 20 of them, to the other
    decode node, which loads them from Redis instead of computing them (before, nothing wrote
    them there)."""
    flags = ("--prefill-nodes", "0", "--decode-nodes", "2", "--kv-transfer", "store", "--num-kv-blocks", "256",
             "--decode-policy", "round_robin")
    with running_cluster(*flags) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        first = _complete(client, PROMPTS[0])
        assert first.choices[0].text == reference[PROMPTS[0]]
        # Node stats come with pongs (every 0.2 s): wait for one from after the request.
        writer = wait_for(lambda: next((n for n, s in node_stats(url).items() if s["requests_total"] == 1), None))
        # The prompt's full blocks, then its answer's (all but the last token's, never computed)
        history_blocks = (first.usage.prompt_tokens + first.usage.completion_tokens - 1) // 16
        wait_for(lambda: node_stats(url)[writer]["writeback_blocks"] == history_blocks)
        second = _complete(client, PROMPTS[1])
        assert second.choices[0].text == reference[PROMPTS[1]]
        assert second.usage.prompt_tokens_details.cached_tokens == 320
        reader = next(n for n in node_stats(url) if n != writer)
        stats = wait_for(lambda: (s := node_stats(url)) and s[reader]["cached_tokens_store"] == 320 and s)
        assert stats[reader]["requests_total"] == 1
        wait_for(lambda: all(s["free_blocks"] == s["total_blocks"] for s in node_stats(url).values()))


def test_a_stalled_store_does_not_hold_the_node_past_its_pongs():
    """The node's loop, which answers the router's pings, asks the store what prefix it holds. With
    Redis stopped (SIGSTOP) the client would wait out its timeout (5 s here): the node computes
    the prompt instead after LOOKUP_TIMEOUT_S, skips lookups while that one is stuck, and finds
    the prefix again once Redis wakes."""
    llm = LLM("builtin:tiny", num_kv_blocks=64)
    engine = llm.engine
    keys = block_key_chain(list(range(100)), 16, b"stalled store")
    with redis_server() as (url, proc):
        store = make_store(url.replace("redis://", "direct+redis://"))
        store.put(keys[:6], engine.kv_cache, list(range(6)), [16] * 6)
        prefix = StorePrefix(engine, store, NodeStats())
        assert prefix.stored_tokens(keys, 100) == 96
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert prefix.stored_tokens(keys, 100) == 0
            assert prefix.stored_tokens(keys, 100) == 0  # the first lookup is still stuck: not queued behind it
            assert time.monotonic() - started < 3 * LOOKUP_TIMEOUT_S + 0.5
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert wait_for(lambda: prefix.stored_tokens(keys, 100) == 96, timeout_s=15)
        prefix.close()
