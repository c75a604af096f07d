"""/v1/embeddings through the official openai client against real clusters (`pdserve up`): one
prefill and one decode node (the prefill node computes them), and the monolithic mode
(--prefill-nodes 0: the decode node does). Each vector must equal transformers' final hidden
state on the same weights (`model.model(...).last_hidden_state`, the final norm applied), pooled
(last token or mean) and L2-normalised, to 1e-5; no KV block stays allocated afterwards.
SmolLM2 (the default model) is checked in test_default_model_tools.py."""
from __future__ import annotations

import base64
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from pdserve import LLM
from pdserve.engine.embedding import EmbeddingBatch
from pdserve.testing.model_factory import make_model
from pdserve.testing.up_cluster import running_clusters


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("emb"), "llama", seed=5)


@pytest.fixture(scope="module")
def reference(model_path):
    model = AutoModel.from_pretrained(str(model_path), torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))

    def embed(ids: list[int], pooling: str = "last") -> np.ndarray:
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
        return (vector / vector.norm()).numpy()

    embed.tokenizer = tokenizer
    return embed


# A chat template that never renders `tools` (the monolithic cluster serves with it).
DROPS_TOOLS = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def clusters(model_path):
    common = ("--model", str(model_path), "--num-kv-blocks", "64")
    template = model_path.parent / "drops_tools.jinja"
    template.write_text(DROPS_TOOLS)
    with running_clusters((*common, "--kv-transfer", "nixl"),
                          (*common, "--prefill-nodes", "0", "--pooling", "mean",
                           "--chat-template", str(template))) as started:
        yield [(url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120))
               for url, _ in started]


def _nodes(url: str, settled=lambda nodes: True) -> list[dict]:
    """The nodes' stats once `settled` holds (they come from pongs, 0.2 s apart), or after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        nodes = httpx.get(f"{url}/health", timeout=10).json()["nodes"]
        if settled(nodes) or time.monotonic() > deadline:
            return nodes
        time.sleep(0.1)


def test_engine_pools_like_transformers_and_frees_its_blocks(model_path, reference):
    """Prompts of 1 token, of several blocks, and more than one step's token budget together."""
    llm = LLM(str(model_path), num_kv_blocks=16, max_num_batched_tokens=64)
    engine = llm.engine
    prompts = [[7], list(range(3, 40)), [9, 8, 7, 6, 5], list(range(100, 160))]
    for pooling in ("last", "mean"):
        batch = EmbeddingBatch(prompts, pooling)
        steps = 0
        while not batch.done:
            assert batch.advance(engine)
            steps += 1
        assert steps >= 2  # 103 tokens: more than one group
        for ids, vector in zip(prompts, batch.vectors):
            np.testing.assert_allclose(vector, reference(ids, pooling), atol=1e-5)
        assert engine.pool.num_free == engine.pool.num_blocks and not engine.pool.cached


def test_embeddings_on_prefill_node_match_transformers(clusters, reference):
    url, client = clusters[0]
    texts = ["The cat sat on the mat.", "A completely different sentence about stars", "x"]
    ids = [list(reference.tokenizer(t)["input_ids"]) for t in texts]
    resp = client.embeddings.create(model=client.models.list().data[0].id, input=texts, encoding_format="float")
    assert [d.index for d in resp.data] == [0, 1, 2]
    for item, want in zip(resp.data, ids):
        np.testing.assert_allclose(item.embedding, reference(want), atol=1e-5)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(map(len, ids))
    # The openai client's default asks for base64 and decodes it: the same vectors.
    by_default = client.embeddings.create(model=resp.model, input=texts)
    assert [d.embedding for d in by_default.data] == [d.embedding for d in resp.data]
    raw = httpx.post(f"{url}/v1/embeddings", json={"input": ids[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.asarray(resp.data[0].embedding, dtype=np.float32))
    # Token-id inputs: one list, and a batch of lists.
    one = client.embeddings.create(model=resp.model, input=ids[1], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, reference(ids[1]), atol=1e-5)
    batch = client.embeddings.create(model=resp.model, input=ids, encoding_format="float")
    assert [d.embedding for d in batch.data] == [d.embedding for d in resp.data]
    # Settled: every request counted and its blocks freed (a pong taken between the node counting
    # a request and freeing its blocks reports them in use; a leak never settles).
    nodes = {n["role"]: n for n in _nodes(url, lambda ns: sum(n["embedding_requests"] for n in ns) == 5
                                          and all(n["kv_blocks_in_use"] == 0 for n in ns))}
    assert nodes["prefill"]["embedding_requests"] == 5 and nodes["decode"]["embedding_requests"] == 0
    assert all(n["kv_blocks_in_use"] == 0 for n in nodes.values())


def test_monolithic_mode_and_mean_pooling(clusters, reference):
    url, client = clusters[1]
    ids = [[5, 6, 7, 8, 9, 10], list(range(20, 70))]
    resp = client.embeddings.create(model=client.models.list().data[0].id, input=ids, encoding_format="float")
    for item, want in zip(resp.data, ids):
        np.testing.assert_allclose(item.embedding, reference(want, "mean"), atol=1e-5)
    (node,) = _nodes(url, lambda ns: ns[0]["embedding_requests"] == 1 and ns[0]["kv_blocks_in_use"] == 0)
    assert node["role"] == "decode" and node["embedding_requests"] == 1 and node["kv_blocks_in_use"] == 0


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "dimensions": 8}, "dimensions"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [1, 10**6]}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "y" * 5000}, "input"),
])
def test_bad_input_is_a_400(clusters, body, param):
    url, _ = clusters[0]
    resp = httpx.post(f"{url}/v1/embeddings", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_template_that_drops_tools_is_named_and_one_call_when_not_parallel(clusters):
    url, client = clusters[1]
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    raw = client.chat.completions.with_raw_response.create(
        model=client.models.list().data[0].id, messages=messages, tools=[WEATHER, WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_tokens=200, temperature=0)
    assert raw.headers["x-tools-ignored"] == "chat template drops tools"
    assert "parallel_tool_calls" not in raw.headers.get("x-ignored-fields", "")
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    plain = client.chat.completions.with_raw_response.create(model=raw.parse().model, messages=messages, max_tokens=2)
    assert "x-tools-ignored" not in plain.headers
