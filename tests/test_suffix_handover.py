"""Only the missing suffix moves (issue 65): a conversation's next turn, on a real 1P1D cluster
over the store (conftest's store_cluster, asked through the official openai client).

The decode node holds the history (the earlier prompt and the answer it generated): the router
says so in the PrefillRequest and the prefill node puts only the blocks after it. The decode
node wrote the answer's whole blocks back to the store, so the prefill node loads them instead of
recomputing the answer; it computes only the rest. Greedy answers are the offline engine's,
token for token."""
from __future__ import annotations

import random

import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.testing.up_cluster import node_stats, wait_for

BS = 16  # the cluster's block size (pdserve up's default)
FIRST, ANSWER, QUESTION = 64, 24, 20  # turn 2: 108 tokens; the decode node holds 80 (5 blocks)


@pytest.fixture(scope="module")
def url(store_cluster):
    return store_cluster


def _turn(client: openai.OpenAI, prompt: list[int]) -> tuple[list[int], int]:
    r = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=ANSWER, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].model_extra["token_ids"], r.usage.prompt_tokens_details.cached_tokens


def _counters(url: str) -> dict[str, int]:
    s = node_stats(url)
    return {"computed": s["prefill-0"]["computed_tokens"], "put": s["prefill-0"]["transfer_bytes_store"],
            "decode_bytes": s["decode-0"]["transfer_bytes_store"], "written": s["decode-0"]["writeback_blocks"],
            "requests": s["prefill-0"]["requests_total"], "per_token": s["prefill-0"]["kv_bytes_per_token"],
            "in_use": s["prefill-0"]["kv_blocks_in_use"]}


def _settled(url: str, requests: int, written: int) -> dict[str, int]:
    """The counters once the prefill node's handover of its `requests`-th request is in and the
    decode node has written `written` blocks back (pongs every 0.2 s carry them)."""
    box = {}

    def done():
        box["c"] = c = _counters(url)
        return c["requests"] >= requests and c["in_use"] == 0 and c["written"] >= written
    wait_for(done)
    return box["c"]


def test_next_turn_hands_over_and_computes_only_the_missing_suffix(url):
    rng = random.Random(65)
    first = [rng.randrange(100, 250) for _ in range(FIRST)]
    question = [rng.randrange(100, 250) for _ in range(QUESTION)]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    llm = LLM("builtin:tiny", num_kv_blocks=64)
    params = SamplingParams(max_tokens=ANSWER, temperature=0, ignore_eos=True)

    start = _counters(url)
    answer, _ = _turn(client, first)
    assert answer == llm.generate({"prompt_token_ids": first}, params, use_tqdm=False)[0].outputs[0].token_ids
    # The answer's one whole block (tokens 64-79; 80-87 end in the last token, whose KV no step computed)
    before = _settled(url, start["requests"] + 1, start["written"] + 1)

    second = first + answer + question
    answer2, cached = _turn(client, second)
    assert answer2 == llm.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0].outputs[0].token_ids
    after = _settled(url, before["requests"] + 1, before["written"])
    block = BS * after["per_token"]
    # 64 tokens from the prefill node's own cache, 16 (the answer's block) from the store
    assert cached == 80 and after["computed"] - before["computed"] == len(second) - 80
    # Put: blocks 5 and 6 (a partial one), none of the five the decode node holds
    assert after["put"] - before["put"] == 2 * block
    # Pulled: the same two; the rest is the decode node writing its answers back
    pulled = after["decode_bytes"] - before["decode_bytes"] - (after["written"] - before["written"]) * block
    assert pulled == 2 * block
