"""use_beam_search over `pdserve up` (1 prefill + 1 decode node), over NIXL and over the store,
through the official openai client: /v1/completions and /v1/chat/completions answer with the
beams LLM.beam_search finds offline, which are transformers' (tests/test_beam_search.py), the
best n of best_of; the prompt is handed over once and the beams fork on the decode node; every
block goes back to the pools after; what beam search cannot take is a
400."""
from __future__ import annotations

import concurrent.futures as cf
import random
import time

import httpx
import openai
import pytest

from pdserve import LLM, BeamSearchParams
from pdserve.testing.beam_reference import reference_beams
from pdserve.testing.model_factory import load_reference, make_model
from pdserve.testing.up_cluster import node_stats, running_clusters, wait_for

TRANSFERS = {"nixl": ("--kv-transfer", "nixl"),
             "store": ("--kv-transfer", "store", "--store-chunk-tokens", "32")}
rng = random.Random(3)
PROMPT = [rng.randrange(3, 256) for _ in range(40)]  # past two blocks: the beams share them
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("beam_pd"), "llama")
    flag_sets = [("--model", str(path), *flags, "--num-kv-blocks", "64") for flags in TRANSFERS.values()]
    with running_clusters(*flag_sets) as clusters:
        yield path, LLM(str(path), num_kv_blocks=64), dict(zip(TRANSFERS, (url for url, _ in clusters)))


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _offline(llm: LLM, prompt: list[int], width: int, max_tokens: int, **kw) -> list[tuple[list[int], str]]:
    out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(width, max_tokens, **kw))[0]
    return [(s.tokens[len(prompt):], s.text) for s in out.sequences]


def _choices(response) -> list[tuple[list[int], str]]:
    return [(c.model_extra["token_ids"], c.text if hasattr(c, "text") else c.message.content)
            for c in response.choices]


@pytest.mark.parametrize("transfer", list(TRANSFERS))
def test_completions_beams_equal_offline_and_transformers(setup, transfer):
    path, llm, urls = setup
    client, model = _client(urls[transfer]), str(path)
    cases = [(4, 4, 10, 1.0), (4, 2, 12, 0.5), (2, 1, 8, 1.0)]  # best_of, n, max_tokens, length_penalty

    def ask(case):
        best_of, n, max_tokens, penalty = case
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, n=n, extra_body={
            "use_beam_search": True, "best_of": best_of, "length_penalty": penalty, "return_token_ids": True})
    with cf.ThreadPoolExecutor(len(cases)) as pool:  # concurrently: their rounds share the nodes
        responses = list(pool.map(ask, cases))
    ref = load_reference(path)
    eos = sorted(llm.engine.outputs.eos_token_ids)
    for (best_of, n, max_tokens, penalty), response in zip(cases, responses):
        want = _offline(llm, PROMPT, best_of, max_tokens, length_penalty=penalty)
        assert _choices(response) == want[:n]
        hf = reference_beams(ref, PROMPT, best_of, max_tokens, penalty, eos_token_ids=eos)
        assert [w[0] for w in want] == [h[0] for h in hf]
    _assert_blocks_back(urls[transfer])


@pytest.mark.parametrize("transfer", list(TRANSFERS))
def test_the_prompt_is_handed_over_once_and_the_beams_fork_on_the_decode_node(setup, transfer):
    """One search, alone on the cluster: the prefill node computes the prompt once (the first
    round), the decode node pulls it once, and every later round runs whole on that decode node."""
    path, llm, urls = setup
    url = urls[transfer]
    prompt = [rng.randrange(3, 256) for _ in range(45)]  # new: no node holds it
    before, placed = node_stats(url), _placed(url)
    r = _client(url).completions.create(model=str(path), prompt=prompt, max_tokens=6, n=2, extra_body={
        "use_beam_search": True, "best_of": 3, "return_token_ids": True})
    assert _choices(r) == _offline(llm, prompt, 3, 6)[:2]

    def counted():  # the nodes' counters ride their pongs
        now = node_stats(url)
        grew = {n: now[n][k] - before[n][k] for n, k in (("prefill-0", "requests_total"), ("decode-0", "transfers_ok"))}
        return grew if all(grew.values()) else None
    time.sleep(1.0)  # a second pull or prefill would show by then
    assert wait_for(counted, timeout_s=30) == {"prefill-0": 1, "decode-0": 1}
    after = _placed(url)
    assert after["placed_remote"] - placed["placed_remote"] == 1
    assert after["placed_local"] > placed["placed_local"]  # the later rounds' beams
    _assert_blocks_back(url)


def _placed(url: str) -> dict[str, int]:
    return httpx.get(f"{url}/health", timeout=10).json()["failover"]


def test_chat_beams_equal_offline(setup):
    path, llm, urls = setup
    url = urls["nixl"]
    ids = httpx.post(f"{url}/tokenize", json={"model": str(path), "messages": MESSAGES,
                                               "add_generation_prompt": True}, timeout=30).json()["tokens"]
    r = _client(url).chat.completions.create(model=str(path), messages=MESSAGES, max_tokens=8, n=2, extra_body={
        "use_beam_search": True, "best_of": 3, "length_penalty": 1.0, "return_token_ids": True})
    assert _choices(r) == _offline(llm, ids, 3, 8)[:2]
    _assert_blocks_back(url)


@pytest.mark.parametrize("extra,field", [({"stream": True}, "stream"), ({"temperature": 0.7}, "temperature"),
                                         ({"best_of": 1, "n": 2}, "best_of"), ({"presence_penalty": 1.0}, None),
                                         ({"best_of": 16}, "best_of")])
def test_what_beam_search_cannot_take_is_400(setup, extra, field):
    path, _, urls = setup
    body = {"model": str(path), "prompt": PROMPT, "max_tokens": 4, "use_beam_search": True, **extra}
    r = httpx.post(f"{urls['nixl']}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    if field:
        assert field in r.text


def test_best_of_without_beam_search_is_still_400(setup):
    path, _, urls = setup
    r = httpx.post(f"{urls['nixl']}/v1/completions", json={"model": str(path), "prompt": PROMPT, "max_tokens": 4,
                                                           "best_of": 2}, timeout=30)
    assert r.status_code == 400 and "use_beam_search" in r.text


def _assert_blocks_back(url: str) -> None:
    wait_for(lambda: all(s["free_blocks"] == s["total_blocks"] and s["requests"] == 0
                         for s in node_stats(url).values() if s["healthy"]), timeout_s=30)
