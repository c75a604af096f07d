"""`pdserve up` 1P1D over the store with speculative decoding on the decode node (the draft
model is the target itself, so every draft is accepted and each step streams several tokens):
greedy output equals the offline engine without speculation, streamed and whole, and every KV
block is back in the pools when the requests are done. A second cluster, started beside it,
drafts with an EAGLE head, which on the decode node drafts over the positions that node
computed (the prompt's hidden states stay on the prefill node): output equal too."""
from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import openai
import pytest
from cluster_util import node_stats, running_clusters, wait_for
from spec_heads import make_eagle_head

from pdserve import LLM, SamplingParams
from pdserve.models.builtin import ensure_builtin_model

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 3, "0123456789" * 4]
MAX_TOKENS = 20
SPEC = {"method": "draft_model", "model": "builtin:tiny", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def reference():
    llm = LLM("builtin:tiny", num_kv_blocks=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return {p: o.outputs[0] for p, o in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False))}


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    head = make_eagle_head(tmp_path_factory.mktemp("eagle"), ensure_builtin_model("builtin:tiny"), seed=5)
    eagle = {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}
    with running_clusters(("--kv-transfer", "store", "--speculative-config", json.dumps(SPEC)),
                          ("--kv-transfer", "store", "--speculative-config", json.dumps(eagle))) as started:
        yield [url for url, _ in started]


@pytest.fixture(scope="module")
def cluster(clusters):
    return clusters[0]


def _complete(client, prompt):
    r = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].model_extra["token_ids"], r.choices[0].text


def test_speculating_decode_node_matches_offline(cluster, reference):
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="none")
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = dict(zip(PROMPTS, pool.map(lambda p: _complete(client, p), PROMPTS)))
    for prompt, (ids, text) in results.items():
        assert ids == reference[prompt].token_ids and text == reference[prompt].text
    stream = client.completions.create(model="builtin:tiny", prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert "".join(chunks) == reference[PROMPTS[1]].text
    wait_for(lambda: node_stats(cluster)["decode-0"]["transfers_ok"] >= len(PROMPTS))
    wait_for(lambda: all(n["free_blocks"] == n["total_blocks"] for n in node_stats(cluster).values()))
    decode = node_stats(cluster)["decode-0"]  # every draft accepted: the target drafts for itself
    assert decode["spec_num_accepted_tokens"] == decode["spec_num_draft_tokens"] > 0
    metrics = httpx.get(f"{cluster}/metrics").text
    assert 'pdserve_spec_decode_num_accepted_tokens_total{node="decode-0"}' in metrics
    assert 'pdserve_spec_decode_num_accepted_tokens_per_pos_total{node="decode-0",position="0"}' in metrics


def test_eagle_decode_node_matches_offline(clusters, reference):
    url = clusters[1]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = dict(zip(PROMPTS, pool.map(lambda p: _complete(client, p), PROMPTS)))
    for prompt, (ids, text) in results.items():
        assert ids == reference[prompt].token_ids and text == reference[prompt].text
    wait_for(lambda: all(n["free_blocks"] == n["total_blocks"] for n in node_stats(url).values()))
    decode = node_stats(url)["decode-0"]
    assert decode["transfers_ok"] >= len(PROMPTS) and decode["spec_num_draft_tokens"] > 0
