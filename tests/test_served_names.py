"""--served-model-name (vLLM's flag) on a real `pdserve up`: the first name is the model's id,
the others are aliases a request may name; /v1/models lists each with `root`, the directory
the router's tokenizer came from, which a client loads to tokenize as the router does;
GET /v1/models/{model} and GET /version answer as OpenAI's and vLLM's servers do."""
from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

import pdserve
from pdserve.entrypoints.cli import build_parser
from pdserve.router.routes.model_routes import served_names
from pdserve.testing.up_cluster import running_cluster

NAMES = ["tiny-chat", "org/tiny-alias"]


@pytest.fixture(scope="module")
def url():
    with running_cluster("--prefill-nodes", "0", "--decode-nodes", "1", "--served-model-name", *NAMES) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_models_lists_every_name_with_the_tokenizers_directory(url, client):
    cards = client.models.list().data
    assert [c.id for c in cards] == NAMES
    roots = {c.model_extra["root"] for c in cards}
    assert len(roots) == 1
    tokenizer = AutoTokenizer.from_pretrained(roots.pop())
    text = "The root directory tokenizes as the router does."
    router_ids = httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]
    assert tokenizer.encode(text) == router_ids


def test_retrieve_each_name_and_404_for_others(client):
    for name in NAMES:
        card = client.models.retrieve(name)
        assert card.id == name and card.object == "model" and card.model_extra["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("builtin:tiny")  # the --model is not a served name once names are given
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"


def test_requests_may_use_any_name_and_get_it_back(client):
    asked = {}
    for name in NAMES:
        r = client.completions.create(model=name, prompt="hello", max_tokens=3, temperature=0)
        asked[name] = (r.model, r.choices[0].text)
    assert {name: model for name, (model, _) in asked.items()} == {n: n for n in NAMES}
    assert len({text for _, text in asked.values()}) == 1  # one model behind both names
    stream = client.chat.completions.create(model=NAMES[1], messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=2, stream=True)
    assert {chunk.model for chunk in stream} == {NAMES[1]}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="builtin:tiny", prompt="hello", max_tokens=2)


def test_no_model_means_the_first_name(url):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["model"] == NAMES[0]


def test_version(url):
    assert httpx.get(f"{url}/version", timeout=10).json() == {"version": pdserve.__version__}


def test_flag_values_split_on_spaces_and_default_to_the_model():
    """compose.yaml passes one `${PDSERVE_SERVED_MODEL_NAME:-}` value: blank or several names."""
    args = build_parser().parse_args(["router", "--model", "builtin:tiny", "--served-model-name", "a b", "c"])
    assert served_names(args.served_model_name, args.model) == ["a", "b", "c"]
    assert served_names([""], "builtin:tiny") == ["builtin:tiny"]
    assert served_names(None, "builtin:tiny") == ["builtin:tiny"]
