"""Per-request P/D placement on a real 1P1D cluster (`pdserve up --prefill-placement slo`, separate
processes, NIXL): a burst of long prompts queues up on the one prefill node, so the router has the
decode node prefill some of them itself. The router's counters and the decode node's own (from its
pongs) show both placements; every request completes with the offline engine's greedy tokens, and
no KV block is left in use.

The TTFT target (1 us) is far below any prompt's cost, so the decision is the comparison of the two
estimates (pd_decision rule 4), not luck with the machine's speed: an idle prefill node ties with
an idle decode node (remote wins ties), and each prompt queued on one side tips the next to the other."""
from __future__ import annotations

import concurrent.futures as cf
import random

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.testing.up_cluster import running_cluster, wait_for

PROMPTS = [[random.Random(i).randrange(5, 250) for _ in range(384)] for i in range(8)]
MAX_TOKENS = 8
FLAGS = ("--kv-transfer", "nixl", "--prefill-nodes", "1", "--decode-nodes", "1", "--num-kv-blocks", "1024",
         "--no-enable-prefix-caching", "--prefill-placement", "slo", "--ttft-slo-ms", "0.001", "--itl-slo-ms", "2000")


@pytest.fixture(scope="module")
def cluster():
    with running_cluster(*FLAGS) as (url, _):
        yield url


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def _decode_node(url: str) -> dict:
    return next(n for n in _health(url)["nodes"] if n["role"] == "decode")


def _complete(client: openai.OpenAI, prompt: list[int], **extra) -> list[int]:
    r = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
    return r.choices[0].model_extra["token_ids"]


def test_burst_is_prefilled_partly_on_the_decode_node(cluster):
    llm = LLM("builtin:tiny", num_kv_blocks=1024, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                         SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                        ignore_eos=True), use_tqdm=False)]
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0, timeout=120)
    assert _complete(client, PROMPTS[0]) == want[0]  # the nodes measure their prefill cost
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: _complete(client, p), PROMPTS))  # a lost request raises here
    assert got == want

    health = _health(cluster)
    counters = health["failover"]
    assert counters["placed_local"] > 0 and counters["placed_remote"] > 0, health
    assert counters["placed_local"] + counters["placed_remote"] == len(PROMPTS) + 1
    assert counters["prefill_retries"] == counters["local_prefills"] == 0  # placements, not fallbacks
    # The decode node's counts reach the router with its pongs: wait until one carries both.
    wait_for(lambda: (lambda n: n["prefills_local"] == counters["placed_local"]
                      and n["prefills_handed_over"] == counters["placed_remote"])(_decode_node(cluster)), timeout_s=30)
    wait_for(lambda: _decode_node(cluster)["kv_blocks_in_use"] == 0 and _decode_node(cluster)["routed_requests"] == 0,
             timeout_s=10)


def test_a_request_s_own_loose_ttft_target_keeps_it_on_the_prefill_node(cluster):
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0, timeout=120)
    before = _health(cluster)["failover"]
    with cf.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: _complete(client, p, ttft_slo_ms=600_000), PROMPTS[:4]))
    after = _health(cluster)["failover"]
    assert after["placed_remote"] - before["placed_remote"] == 4 and after["placed_local"] == before["placed_local"]
