"""Valid requests at the edges of the sampling ranges never answer 5xx, and their logprobs are
finite JSON numbers; values outside OpenAI's ranges are a 400 in OpenAI's shape.

Two requests that answered 500 before: a JSON schema with top_logprobs (a token the grammar
rules out has logprob -inf, which JSON cannot carry) and a repetition_penalty of 5e-324 (it
is 0 in float32, so a penalised logit overflowed to inf and the row's logprobs became NaN).
Both are checked against the offline engine on the same model: the same tokens, the same
logprobs, where the engine's -inf (or saturated) values read -9999.0, as vLLM's server clamps
them. Then a sweep: structured outputs x logprobs (top, echoed prompt, vLLM's prompt_logprobs)
x penalty and logit_bias extremes, streamed and not, on a real 1 prefill + 1 decode cluster.
"""
from __future__ import annotations

import itertools
import json
import math

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.protocol.sampling_params import StructuredSpec

FLOOR = -9999.0
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Give me a JSON object."}]


@pytest.fixture(scope="module")
def url(plain_cluster):
    """One prefill and one decode node, KV over NIXL (up's default): conftest's cluster, shared
    with other modules."""
    return plain_cluster


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny", num_kv_blocks=64)


def _strict_json(text: str):
    """json.loads that refuses NaN and +-Infinity (Python's default takes them)."""
    def refuse(literal):
        raise AssertionError(f"{literal} in a response")
    return json.loads(text, parse_constant=refuse)


def _numbers(node, key_hint: str = ""):
    """Every float under a key holding 'logprob' in `node`."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _numbers(value, key if "logprob" in key else key_hint)
    elif isinstance(node, list):
        for value in node:
            yield from _numbers(value, key_hint)
    elif isinstance(node, float) and key_hint:
        yield node


def _expected(value: float) -> float:
    return max(value, FLOOR)  # max(-inf, FLOOR) is FLOOR


def _same_logprobs(got: float, engine: float) -> None:
    assert math.isfinite(got) and got == pytest.approx(_expected(engine), abs=1e-4), (got, engine)


def test_json_schema_with_top_logprobs_is_200_with_the_engines_logprobs(url, llm):
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 20,
            "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA}}}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    content = _strict_json(resp.text)["choices"][0]["logprobs"]["content"]
    prompt = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()["tokens"]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=20,
                            structured=StructuredSpec("json", json.dumps(SCHEMA)))
    engine = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].logprobs
    assert len(content) == len(engine) == 6
    ruled_out = 0
    for entry, lp in zip(content, engine):
        _same_logprobs(entry["logprob"], lp.logprob)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx([_expected(v) for _, v in lp.top],
                                                                             abs=1e-4)
        ruled_out += sum(v == -math.inf for _, v in lp.top)
    assert ruled_out > 0  # the grammar really left -inf among the top 20: the case that failed


def test_tiny_repetition_penalty_is_200_with_the_engines_logprobs(url, llm):
    prompt = [5, 9, 5, 12, 40, 9, 77]
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "repetition_penalty": 5e-324, "logprobs": 5}
    for stream in (False, True):
        resp = httpx.post(f"{url}/v1/completions", json={**body, "stream": stream}, timeout=60)
        assert resp.status_code == 200, resp.text
        if stream:
            chunks = [_strict_json(line[6:]) for line in resp.text.splitlines()
                      if line.startswith("data: {")]
            got = [v for c in chunks for v in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
        else:
            got = _strict_json(resp.text)["choices"][0]["logprobs"]["token_logprobs"]
        params = SamplingParams(max_tokens=5, temperature=0, repetition_penalty=5e-324, logprobs=5)
        engine = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].logprobs
        assert len(got) == len(engine) == 5
        for value, lp in zip(got, engine):
            _same_logprobs(value, lp.logprob)


STRUCTURED = [{}, {"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA}}},
              {"structured_outputs": {"regex": "[a-c]{2}[0-9]+"}}, {"structured_outputs": {"choice": ["yes", "no"]}}]
EXTREMES = [{"repetition_penalty": 5e-324, "logit_bias": {str(t): 100 for t in range(3, 40)}},
            {"repetition_penalty": 100, "presence_penalty": -2, "frequency_penalty": -2, "temperature": 2},
            {"presence_penalty": 2, "frequency_penalty": 2, "logit_bias": {str(t): -100 for t in range(3, 200)},
             "temperature": 1e-5, "top_p": 1e-300},
            {"logit_bias": {"5": 100, "6": -100}, "min_p": 1, "top_k": 1, "seed": 7, "temperature": 0}]


def _sweep_bodies():
    for i, (structured, extreme) in enumerate(itertools.product(STRUCTURED, EXTREMES)):
        stream = i % 2 == 1
        yield "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 20,
                                       "stream": stream, **structured, **extreme}
        yield "/v1/completions", {"prompt": "say it:", "max_tokens": 4, "logprobs": 20, "echo": True,
                                  "prompt_logprobs": 20, "stream": not stream, **structured, **extreme}


def test_sweep_of_structured_outputs_logprobs_and_extremes_has_no_5xx(url):
    seen = 0
    with httpx.Client(timeout=60) as http:
        for path, body in _sweep_bodies():
            resp = http.post(f"{url}{path}", json=body)
            assert resp.status_code == 200, (path, body, resp.text)
            events = ([line[6:] for line in resp.text.splitlines() if line.startswith("data: {")]
                      if body["stream"] else [resp.text])
            for event in events:
                parsed = _strict_json(event)
                assert "error" not in parsed, (path, body, parsed)
                values = list(_numbers(parsed))
                assert all(FLOOR <= v <= 0 for v in values), (path, body, values)
                seen += len(values)
    assert seen > 1000  # top 20 of every token and every prompt token: logprobs were really checked


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "temperature": 2.01}, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 5}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": None}, *MESSAGES]}, "messages.0"),
    ("/v1/chat/completions", {"messages": [{"role": "developer"}, *MESSAGES]}, "messages.0"),
    ("/v1/chat/completions", {"messages": [*MESSAGES, {"role": "assistant"}]}, "messages.1"),
    ("/v1/chat/completions", {"messages": [*MESSAGES, {"role": "tool", "tool_call_id": "c1"}]}, "messages.1"),
    ("/v1/chat/completions", {"messages": [*MESSAGES, {"role": "function", "content": "{}"}]}, "messages.1"),
])
def test_out_of_range_values_and_malformed_messages_are_400(url, path, body, param):
    resp = httpx.post(f"{url}{path}", json={"max_tokens": 2, **body}, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_openai_client_gets_the_400_and_the_edges_still_work(client):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "user"}], max_tokens=2)
    # The bounds themselves are accepted; an assistant turn that only called a tool needs no content.
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [*MESSAGES, {"role": "assistant", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"},
               {"role": "function", "name": "f", "content": None}]
    for temperature in (0, 2):
        r = client.chat.completions.create(model=model, messages=history, max_tokens=2, temperature=temperature)
        assert r.choices[0].finish_reason in ("length", "stop")


def test_top_p_below_float32s_range_keeps_the_most_likely_token(llm):
    """top_p 1e-300 is 0 in float32; it once masked every token, and argmax drew token 0."""
    prompt = {"prompt_token_ids": [5, 9, 5, 12, 40]}
    greedy = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    for seed in range(3):
        sampled = llm.generate(prompt, SamplingParams(max_tokens=4, top_p=1e-300, seed=seed), use_tqdm=False)[0]
        assert sampled.outputs[0].token_ids == greedy.outputs[0].token_ids
