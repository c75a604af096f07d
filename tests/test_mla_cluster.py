"""A DeepSeek-V3 (MLA latent cache) checkpoint served by a real `pdserve up` cluster: prefill and
decode nodes in separate processes hand the latent blocks over NIXL, or through LMCache + Redis,
and the official openai client gets the offline engine's tokens, greedy and seeded."""
from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import time

import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.protocol.sampling_params import StructuredSpec
from pdserve.testing.model_factory import make_deepseek
from pdserve.testing.up_cluster import node_pids, node_stats, running_cluster, wait_for

PROMPTS = ["Hello latent world", "Multi-head latent attention caches one vector per token. " * 2,
           "x", "0123456789" * 5]
MAX_TOKENS = 10
SEEDED = dict(max_tokens=8, temperature=0.9, top_p=0.95, seed=11)
REGEX = "[a-z]{2,6} [0-9]{2,4}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_deepseek(tmp_path_factory.mktemp("mla"), "deepseek_v3"))


@pytest.fixture(scope="module")
def offline(checkpoint):
    llm = LLM(checkpoint, num_kv_blocks=256)
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                          use_tqdm=False)
    seeded = llm.generate(PROMPTS[1], SamplingParams(**SEEDED, ignore_eos=True), use_tqdm=False)
    regex = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0, structured=StructuredSpec("regex", REGEX)),
                         use_tqdm=False)
    return ({p: o.outputs[0].token_ids for p, o in zip(PROMPTS, greedy)}, seeded[0].outputs[0].token_ids,
            regex[0].outputs[0].token_ids)


def _complete(client: openai.OpenAI, model: str, prompt: str, **params) -> tuple[list[int], int]:
    r = client.completions.create(model=model, prompt=prompt, **{"max_tokens": MAX_TOKENS, "temperature": 0, **params},
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].model_extra["token_ids"], r.usage.prompt_tokens_details.cached_tokens


CLUSTERS = {
    "nixl": ("--kv-transfer", "nixl"),
    # Two prefill nodes: the second request for a prompt goes to the other one, which loads the
    # prompt's latent blocks from the store (32-token LMCache chunks, partial ones in Redis).
    "lmcache": ("--prefill-nodes", "2", "--prefill-policy", "round_robin", "--kv-transfer", "store",
                "--store", "lmcache+redis://", "--store-chunk-tokens", "32"),
}


@pytest.mark.parametrize("mode", list(CLUSTERS))
def test_pd_over_latent_cache_matches_offline(mode, checkpoint, offline):
    greedy, seeded, regex = offline
    with running_cluster("--model", checkpoint, *CLUSTERS[mode]) as (url, proc):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = dict(zip(PROMPTS, pool.map(lambda p: _complete(client, checkpoint, p), PROMPTS)))
        for prompt, (ids, _) in results.items():
            assert ids == greedy[prompt], f"{mode}: tokens differ for {prompt!r}"
        ids, _ = _complete(client, checkpoint, PROMPTS[1], **SEEDED)
        assert ids == seeded, f"{mode}: seeded sampling differs from the offline engine"
        if mode == "nixl":  # structured output: the grammar replayed on the decode node
            r = client.completions.create(model=checkpoint, prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                          extra_body={"structured_outputs": {"regex": REGEX}, "return_token_ids": True})
            assert re.fullmatch(REGEX, r.choices[0].text) and r.choices[0].model_extra["token_ids"] == regex
        if mode == "lmcache":
            ids, cached = _complete(client, checkpoint, PROMPTS[1])
            assert ids == greedy[PROMPTS[1]]
            assert cached >= 96, f"the prompt's full blocks should be reused, cached {cached}"
            wait_for(lambda: sum(n.get("cached_tokens_store", 0) for n in node_stats(url).values()) >= 96)
            _kill_prefill_node_under_load(url, proc, checkpoint, greedy)
        wait_for(lambda: node_stats(url)["decode-0"]["transfers_ok"] >= len(PROMPTS))
        assert node_stats(url)["decode-0"]["transfers_failed"] == 0
        wait_for(lambda: all(n["free_blocks"] == n["total_blocks"] for n in node_stats(url).values() if n["healthy"]))


def _kill_prefill_node_under_load(url: str, proc, model: str, greedy: dict[str, list[int]]) -> None:
    """SIGKILL prefill-0 while requests are in flight: none fails (no client retries), and the
    tokens are still the offline engine's."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    victim = node_pids(proc.pid)["prefill-0"]
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(_complete, client, model, p) for p in PROMPTS]
        time.sleep(0.3)
        os.kill(victim, signal.SIGKILL)
        got = [f.result()[0] for f in futures]
    assert got == [greedy[p] for p in PROMPTS]
