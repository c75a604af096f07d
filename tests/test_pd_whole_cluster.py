"""The monolithic fallback of --prefill-placement slo on a real 1P1D cluster (`pdserve up`, separate
processes, NIXL): when the decode node's steps have no room left under the ITL target, the router
sends a request whole to the prefill node, which prefills and decodes it there.

The ITL target (1 ms) is below any step, so once the decode node has measured its steps and holds
one stream it has no headroom (pd_decision rule 2), while the idle prefill node has; the TTFT
target is loose, so the first request goes remote as usual. That makes the placements a function
of the cluster's state, not of the machine's speed.

- the request placed whole streams the offline engine's greedy tokens, the router counts it as
  `placed_whole`, the prefill node as `whole_requests`, and every KV block is freed afterwards;
- the prefill node SIGKILLed in the middle of a whole request's stream: the stream resumes on the
  decode node with identical output, and the router counts the resume.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import random
import signal

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.testing.up_cluster import KILL_PACE, node_pids, node_stats, running_cluster, wait_for

PROMPTS = [[random.Random(i).randrange(5, 250) for _ in range(96)] for i in range(3)]
LONG = 600  # at KILL_PACE the first stream keeps the decode node busy (6 s) while the others are placed
SHORT = 48
FLAGS = ("--kv-transfer", "nixl", "--prefill-nodes", "1", "--decode-nodes", "1", "--num-kv-blocks", "1024",
         "--no-enable-prefix-caching", "--prefill-placement", "slo", "--ttft-slo-ms", "600000",
         "--itl-slo-ms", "1", *KILL_PACE)


@pytest.fixture(scope="module")
def offline():
    llm = LLM("builtin:tiny", num_kv_blocks=1024, enable_prefix_caching=False)
    lengths = (LONG, SHORT, 400)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    outs = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0] for p, sp in zip(PROMPTS, params)]
    return [o.outputs[0].token_ids for o in outs]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)


def _stream(client: openai.OpenAI, prompt: list[int], max_tokens: int, on_token=None) -> list[int]:
    tokens: list[int] = []
    stream = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    for chunk in stream:
        tokens += chunk.choices[0].model_extra.get("token_ids") or []
        if on_token is not None:
            on_token(len(tokens))
    return tokens


def _failover(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()["failover"]


def _decode_busy_and_measured(url: str) -> bool:
    node = node_stats(url)["decode-0"]
    return node["routed_requests"] == 1 and node["step_base_us"] + node["decode_row_us"] > 0


def test_whole_requests_on_the_prefill_node_and_their_failover(offline):
    with running_cluster(*FLAGS) as (url, proc), cf.ThreadPoolExecutor(2) as pool:
        client = _client(url)
        first = pool.submit(_stream, client, PROMPTS[0], LONG)
        wait_for(lambda: _decode_busy_and_measured(url), timeout_s=60)
        assert _failover(url)["placed_remote"] == 1

        # The decode node has no room under 1 ms: the next request runs whole on the prefill node.
        assert _stream(client, PROMPTS[1], SHORT) == offline[1]
        counters = _failover(url)
        assert counters["placed_whole"] == 1 and counters["placed_local"] == 0, counters
        wait_for(lambda: node_stats(url)["prefill-0"]["whole_requests"] == 1, timeout_s=10)

        # Kill the prefill node while a whole request streams from it: it resumes on the decode node.
        killed = []

        def kill_prefill(received: int) -> None:
            if received >= 20 and not killed:
                killed.append(received)
                os.kill(node_pids(proc.pid)["prefill-0"], signal.SIGKILL)

        resumes = counters["decode_resumes"]
        assert _stream(client, PROMPTS[2], 400, kill_prefill) == offline[2]
        assert killed, "the whole request ended before the prefill node could be killed"
        after = _failover(url)
        assert after["placed_whole"] == 2 and after["decode_resumes"] == resumes + 1, after

        assert first.result() == offline[0]  # the stream on the decode node was untouched
        wait_for(lambda: node_stats(url)["decode-0"]["kv_blocks_in_use"] == 0, timeout_s=10)
        # The restarted prefill node is back, with nothing held.
        wait_for(lambda: node_stats(url).get("prefill-0", {}).get("healthy")
                 and node_stats(url)["prefill-0"]["kv_blocks_in_use"] == 0, timeout_s=120)
