"""Structured outputs (xgrammar): a random-weight model, which would otherwise babble, returns
output that matches the schema / regex / choice, offline and through real clusters (NIXL, the
store, monolithic) with the official openai client; greedy output is identical on all paths.

JSON is parsed strictly (json.loads(strict=True)): no raw control characters in strings.
"""
from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import openai
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.protocol.sampling_params import StructuredSpec
from pdserve.testing.model_factory import make_model
from pdserve.testing.up_cluster import running_cluster

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "ok", "tags", "note"],
          "properties": {"name": {"enum": ["ada", "bob", "cy"]},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
                         "note": {"type": "string", "maxLength": 12}}}
REGEX = r"[a-z]{2,5}-[0-9]{3}"
CHOICES = ["alpha", "beta", "gamma delta"]
PROMPTS = ["Describe a person:", "JSON please", "x", "The quick brown fox jumps"]


def _valid(text: str, schema=SCHEMA) -> None:
    jsonschema.validate(json.loads(text, strict=True), schema)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("so"), "llama", seed=5)


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(str(model_path), num_kv_blocks=256)


def _params(kind: str, **kw) -> SamplingParams:
    spec = {"json": json.dumps(SCHEMA), "regex": REGEX, "choice": json.dumps(CHOICES)}[kind]
    return SamplingParams(max_tokens=150, structured=StructuredSpec(kind, spec), **kw)


def test_unconstrained_model_babbles(llm):
    """Without a grammar this model's output is neither JSON nor the regex: the tests below
    measure the constraint, not the model."""
    for prompt in PROMPTS:
        text = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0].outputs[0].text
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            _valid(text)
        assert not re.fullmatch(REGEX, text)


@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_every_output_matches_its_grammar_in_a_mixed_batch(llm, seed):
    temp = 0.0 if seed is None else 1.0
    prompts, params = [], []
    for i, prompt in enumerate(PROMPTS):
        for kind in ("json", "regex", "choice"):
            prompts.append(prompt)
            params.append(_params(kind, temperature=temp, seed=None if seed is None else seed + i))
        prompts.append(prompt)  # an unconstrained row in the same batch
        params.append(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for prompt, p, out in zip(prompts, params, outs):
        assert out.finish_reason == "stop" or p.structured is None
        if p.structured is None:  # unconstrained rows are exactly what they are alone
            alone = llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]
            assert out.token_ids == alone.token_ids
        elif p.structured.kind == "json":
            _valid(out.text)
        elif p.structured.kind == "regex":
            assert re.fullmatch(REGEX, out.text), out.text
        else:
            assert out.text in CHOICES


def test_each_spec_compiles_once_per_process(model_path):
    fresh = LLM(str(model_path), num_kv_blocks=64)
    params = [_params(kind, temperature=1.0, seed=i) for i in range(3) for kind in ("json", "regex", "choice")]
    fresh.generate(PROMPTS[:1] * len(params), params, use_tqdm=False)
    fresh.generate(PROMPTS[:1] * len(params), params, use_tqdm=False)
    info = fresh.engine.structured.compiled.cache_info()
    assert info.misses == 3 and info.hits == 2 * len(params) - 3


def test_matcher_masks_exactly_the_grammar(llm):
    """The first token's distribution is the model's, renormalised over the tokens xgrammar
    allows (direct check of the bitmask against the matcher's own answer)."""
    import xgrammar as xgr
    prompt = llm.get_tokenizer().encode("JSON please")
    p = _params("json", temperature=0, logprobs=5)
    out = llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0].outputs[0]
    matcher = llm.engine.structured.new_matcher(p.structured, [])
    bitmask = xgr.allocate_token_bitmask(1, llm.engine.model.spec.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    logits = llm.engine.prompt_logits(prompt)[-1:].clone()
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    assert out.token_ids[0] == int(logits.argmax())
    assert abs(out.logprobs[0].logprob - float(torch.log_softmax(logits, -1)[0, out.token_ids[0]])) < 1e-4


def test_grammar_and_logit_edits_compose(llm):
    """The edits act first, the bitmask after: a bias picks among the grammar's choices; edits
    that bar every token the grammar allows end the request instead of leaving the grammar."""
    tok = llm.get_tokenizer()
    first = {c: tok.encode(c[0], add_special_tokens=False)[0] for c in CHOICES}
    for choice, token in first.items():
        p = _params("choice", temperature=0, logit_bias={token: 100.0})
        assert llm.generate(PROMPTS[1], p, use_tqdm=False)[0].outputs[0].text == choice
    barred = _params("choice", temperature=0, bad_words_token_ids=[[t] for t in first.values()])
    out = llm.generate(PROMPTS[1], barred, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "grammar_dead_end" and len(out.token_ids) == 1


def _continue(engine, rid, params, prompt, produced):
    engine.add_request(rid, prompt, params, output_token_ids=list(produced))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_handover_rebuilds_the_matcher_from_the_tokens_so_far(llm, kind):
    """Prefill node: the first token under the grammar. Decode node (and a failover's next
    node): a new matcher advanced with the tokens already produced, then the same output."""
    prompt = llm.get_tokenizer().encode(PROMPTS[0])
    params = _params(kind, temperature=0.8, seed=11)
    whole = _continue(llm.engine, f"{kind}-whole", params, prompt, [])
    first = _continue(llm.engine, f"{kind}-first", dataclasses.replace(params, max_tokens=1), prompt, [])
    assert first == whole[:1]
    for k in (1, 4, len(whole) // 2):
        assert whole[:k] + _continue(llm.engine, f"{kind}-{k}", params, prompt, whole[:k]) == whole
    with pytest.raises(ValueError):  # tokens the grammar could not have produced are refused
        llm.engine.add_request(f"{kind}-bad", prompt, params, output_token_ids=[llm.get_tokenizer().encode("~")[0]] * 2)


CLUSTERS = {"nixl": ("--kv-transfer", "nixl"), "store": ("--kv-transfer", "store"),
            "monolithic": ("--prefill-nodes", "0")}
GREEDY: dict[str, dict[str, list[int]]] = {}  # mode -> prompt -> token ids
TOOL = {"type": "function", "function": {"name": "set_person", "description": "Store a person",
                                         "parameters": SCHEMA}}


@pytest.fixture(scope="module", params=list(CLUSTERS))
def cluster(request, model_path):
    with running_cluster("--model", str(model_path), *CLUSTERS[request.param]) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        yield request.param, client


def _json_schema_format():
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def test_cluster_json_schema_valid_and_greedy_identical_everywhere(cluster, llm):
    mode, client = cluster
    got = {}
    for prompt in PROMPTS:
        r = client.completions.create(model=str(llm.engine.model_path), prompt=prompt, max_tokens=150,
                                      temperature=0, extra_body={"response_format": _json_schema_format(),
                                                                 "return_token_ids": True})
        _valid(r.choices[0].text)
        got[prompt] = r.choices[0].model_extra["token_ids"]
        want = llm.generate(prompt, _params("json", temperature=0), use_tqdm=False)[0].outputs[0]
        assert got[prompt] == want.token_ids and r.choices[0].text == want.text, mode
    GREEDY[mode] = got
    assert all(g == got for g in GREEDY.values()), "greedy output differs between P/D paths"


def test_cluster_sampled_requests_all_match(cluster, llm):
    mode, client = cluster
    model = str(llm.engine.model_path)
    for seed in range(3):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[seed]}],
                                           max_tokens=150, temperature=1.0, seed=seed,
                                           response_format=_json_schema_format())
        _valid(r.choices[0].message.content)
        # Any object: this model never closes one on its own (keys run to max_tokens), so a
        # bias on "}" (logit_bias and the grammar together) lets it end; the text must parse.
        close = str(llm.get_tokenizer().encode("}", add_special_tokens=False)[0])
        obj = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[seed]}],
                                             max_tokens=200, temperature=1.0, seed=seed, logit_bias={close: 6},
                                             response_format={"type": "json_object"})
        assert obj.choices[0].finish_reason == "stop", mode
        assert isinstance(json.loads(obj.choices[0].message.content, strict=True), dict), mode
        text = client.completions.create(model=model, prompt=PROMPTS[seed], max_tokens=20, temperature=1.0,
                                         seed=seed, extra_body={"guided_regex": REGEX}).choices[0].text
        assert re.fullmatch(REGEX, text), (mode, text)
        for body in ({"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}):
            text = client.completions.create(model=model, prompt=PROMPTS[seed], max_tokens=20, temperature=1.0,
                                             seed=seed, extra_body=body).choices[0].text
            assert text in CHOICES, (mode, text)


def test_cluster_named_tool_choice_returns_tool_calls(cluster, llm):
    mode, client = cluster
    kwargs = dict(model=str(llm.engine.model_path), messages=[{"role": "user", "content": "add ada"}],
                  max_tokens=150, temperature=0, tools=[TOOL],
                  tool_choice={"type": "function", "function": {"name": "set_person"}})
    r = client.chat.completions.create(**kwargs)
    message = r.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "set_person" and call.id.startswith("call_")
    _valid(call.function.arguments)
    pieces, names, ids = [], [], []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            pieces.append(delta_call.function.arguments or "")
            names += [delta_call.function.name] if delta_call.function.name else []
            ids += [delta_call.id] if delta_call.id else []
    assert "".join(pieces) == call.function.arguments and names == ["set_person"] and len(ids) == 1, mode


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    {"response_format": {"type": "yaml"}},
    {"guided_regex": "a(b"},
    {"guided_json": "{not json"},
    {"guided_choice": []},
    {"structured_outputs": {"grammar": "root ::= "}},
    {"guided_regex": "a", "guided_choice": ["a"]},
    {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tools": [TOOL], "tool_choice": "any"},
    {"tools": [TOOL], "tool_choice": {"type": "function", "function": "set_person"}},
    {"tools": [{"type": "function", "function": {"name": "t", "parameters": {"type": "nonsense"}}}],
     "tool_choice": {"type": "function", "function": {"name": "t"}}}])
def test_cluster_malformed_specs_are_openai_400s(cluster, llm, body):
    mode, client = cluster
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=str(llm.engine.model_path), messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, extra_body=body)
    assert err.value.status_code == 400 and err.value.body["type"] == "invalid_request_error"
    assert err.value.body["message"]
