"""Cache-aware routing on a real cluster (1 prefill + 2 decode nodes over NIXL, official openai
client): a multi-round conversation stays on the decode node that holds its history, its
follow-up turns are prefilled there with no handover (conditional disaggregation) and report
the history as cached_tokens; greedy output is the offline engine's. Plus the policies alone."""
from __future__ import annotations

import time

import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.protocol.block_keys import block_key_chain
from pdserve.router.placement.index import PrefixIndex
from pdserve.router.placement.policy import NodeView, Planner
from pdserve.testing.up_cluster import node_stats, running_cluster, wait_for

TURN = 48        # tokens the user adds per round
ANSWER = 16      # tokens generated per round
THRESHOLD = 96   # a follow-up lacks at most TURN + a partial block + the last answer token


def _turn(user: int, rnd: int) -> list[int]:
    return [(7 * user + 13 * rnd + i) % 200 + 20 for i in range(TURN)]


@pytest.fixture(scope="module")
def cluster():
    with running_cluster("--kv-transfer", "nixl", "--prefill-nodes", "1", "--decode-nodes", "2",
                         "--num-kv-blocks", "512", "--local-prefill-threshold", str(THRESHOLD)) as (url, proc):
        yield url


def _handovers(url: str) -> int:
    return sum(s["requests_total"] for s in node_stats(url).values() if s["role"] == "prefill")


def test_follow_up_turns_stay_local_with_history_cached(cluster):
    url = cluster
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    llm = LLM("builtin:tiny", num_kv_blocks=512)
    params = SamplingParams(max_tokens=ANSWER, temperature=0, ignore_eos=True)
    for user in range(2):
        history: list[int] = [(user * 31 + i) % 200 + 20 for i in range(160)]  # a long opening prompt
        for rnd in range(3):
            prompt = history + _turn(user, rnd)
            before = _handovers(url)
            r = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=ANSWER, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            ids = r.choices[0].model_extra["token_ids"]
            want = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
            assert ids == want
            cached = r.usage.prompt_tokens_details.cached_tokens
            if rnd == 0:
                wait_for(lambda: _handovers(url) == before + 1)  # a cold prompt is disaggregated
            else:
                time.sleep(0.6)  # counters arrive with the nodes' pongs (every 0.2 s)
                assert _handovers(url) == before, "a follow-up turn went through the prefill node"
                # Its history (all but the last answer token, whose KV was never computed) was cached.
                assert cached >= (len(history) - 1) // 16 * 16 > 0
            history = prompt + ids


def test_planner_prefers_the_holder_unless_it_is_overloaded():
    index = PrefixIndex()
    keys = block_key_chain(list(range(64)), 16, b"salt")
    index.add("d1", keys[:3])
    planner = Planner(index, 16, local_prefill_threshold=20)
    views = [NodeView("d0", 0, 100, 100), NodeView("d1", 2, 100, 100)]
    plan = planner.plan("r", 64, keys, views, [NodeView("p0")])
    assert plan.decode == "d1" and plan.decode_cached_tokens == 48 and plan.prefill is None
    plan = planner.plan("r", 64, keys, [NodeView("d0", 0, 100, 100), NodeView("d1", 20, 100, 100)], [NodeView("p0")])
    assert plan.decode == "d0" and plan.prefill == "p0"  # the holder is a hot spot: balance wins
    # A node that cannot fit the request is never chosen while another can.
    plan = planner.plan("r", 64, keys, [NodeView("d0", 0, 100, 100), NodeView("d1", 0, 0, 100)], [],
                        max_tokens=64)
    assert plan.decode == "d0"
    rr = Planner(index, 16, "round_robin", "round_robin")
    assert {rr.plan("r", 64, keys, views, []).decode for _ in range(4)} == {"d0", "d1"}


def test_index_is_bounded_and_forgets_dead_nodes():
    index = PrefixIndex(max_keys=4)
    keys = block_key_chain(list(range(96)), 16, b"salt")
    index.add("a", keys)
    assert index.size("a") == 4 and index.held_prefix_blocks("a", keys) == 0  # oldest went first
    index.add("b", keys[:2])
    index.drop_node("b")
    assert index.size("b") == 0 and index.held_prefix_blocks("b", keys) == 0


def test_cached_tokens_reported_alike_streamed_unstreamed_and_for_n_2(cluster):
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0, timeout=120)
    prompt = [(5 * i) % 200 + 20 for i in range(130)]
    args = dict(model="builtin:tiny", prompt=prompt, max_tokens=4, temperature=0)
    client.completions.create(**args)  # now every block of it is cached somewhere
    plain = client.completions.create(**args).usage.prompt_tokens_details.cached_tokens
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    streamed = chunks[-1].usage.prompt_tokens_details.cached_tokens
    both = client.completions.create(**{**args, "temperature": 0.8}, n=2, seed=3)
    assert len(both.choices) == 2 and both.usage.prompt_tokens == len(prompt)
    assert plain == streamed == both.usage.prompt_tokens_details.cached_tokens >= 112


def test_pinned_session_wins_unless_its_node_is_a_hot_spot():
    planner = Planner(PrefixIndex(), 16, "least_loaded", "least_loaded")
    views = [NodeView("d0", 0, 100, 100), NodeView("d1", 3, 100, 100)]
    assert planner.plan("r", 40, [], views, [], 8, pinned_decode="d1").decode == "d1"
    views[1].in_flight = 20
    assert planner.plan("r", 40, [], views, [], 8, pinned_decode="d1").decode == "d0"


def test_session_affinity_keeps_each_user_on_one_decode_node():
    with running_cluster("--prefill-nodes", "0", "--decode-nodes", "2", "--decode-policy", "round_robin",
                         "--session-affinity", "--num-kv-blocks", "256") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        for user in ("alice", "bob", "carol"):
            before = {k: s["requests_total"] for k, s in node_stats(url).items()}
            for i in range(4):
                client.completions.create(model="builtin:tiny", prompt=f"{user} turn {i}", max_tokens=2,
                                          temperature=0, user=user)
            wait_for(lambda: sum(s["requests_total"] for s in node_stats(url).values()) == sum(before.values()) + 4)
            moved = sorted(s["requests_total"] - before[k] for k, s in node_stats(url).items())
            assert moved == [0, 4], f"{user}'s requests were spread over the nodes: {moved}"


def test_prefill_goes_to_the_lowest_estimated_ttft():
    index = PrefixIndex()
    keys = block_key_chain(list(range(160)), 16, b"salt")
    index.add("p1", keys[:8])  # p1 holds 128 of the 160 tokens
    planner = Planner(index, 16)
    decode = [NodeView("d0", 0, 100, 100)]
    idle, warm = NodeView("p0", 0, 0, 0, queued_tokens=0), NodeView("p1", 1, 0, 0, queued_tokens=100)
    # p0 computes 160 tokens; p1 has 100 queued plus 32 of its own: p1 answers first.
    assert planner.plan("r", 160, keys, decode, [idle, warm]).prefill == "p1"
    warm.queued_tokens = 200  # 232 > 160: now the idle node is quicker despite the cold cache
    assert planner.plan("r", 160, keys, decode, [idle, warm]).prefill == "p0"
