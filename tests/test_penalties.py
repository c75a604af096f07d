"""Penalties, logit_bias, min_tokens and bad words: per request, batched, on both node kinds.

References: transformers' own logits processors (RepetitionPenalty, MinNewTokensLength,
NoBadWords, SequenceBias) and, for presence/frequency penalties, OpenAI's formula written out
here. Generation is compared with transformers' generate() on the same random weights; the P/D
cluster (real processes, official openai client) with the offline engine.
"""
from __future__ import annotations

import dataclasses

import openai
import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from pdserve import LLM, SamplingParams
from pdserve.engine.logits_processors import apply_logits_processors
from pdserve.testing.model_factory import load_reference, make_model

VOCAB = 97
EOS = 3


class OpenAIPenalty(LogitsProcessor):
    """OpenAI's formula over generated tokens: l[j] -= c[j]*frequency + (c[j]>0)*presence."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row in range(scores.shape[0]):
            for token in set(input_ids[row, self.prompt_len:].tolist()):
                count = int((input_ids[row, self.prompt_len:] == token).sum())
                scores[row, token] -= count * self.frequency + self.presence
        return scores


@dataclasses.dataclass
class History:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


def hf_processors(params: SamplingParams, prompt_len: int, eos: int) -> LogitsProcessorList:
    """The same edits as transformers processors, in pdserve's (vLLM's) order."""
    procs: list[LogitsProcessor] = []
    if params.bad_words_token_ids:
        procs.append(NoBadWordsLogitsProcessor(params.bad_words_token_ids, eos_token_id=None))
    if params.min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, params.min_tokens,
                                                       eos_token_id=[eos, *params.stop_token_ids]))
    if params.logit_bias:
        procs.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias.items()]))
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        procs.append(OpenAIPenalty(prompt_len, params.presence_penalty, params.frequency_penalty))
    return LogitsProcessorList(procs)


CASES = {
    "repetition": SamplingParams(repetition_penalty=1.7),
    "repetition_below_one": SamplingParams(repetition_penalty=0.6),
    "presence_frequency": SamplingParams(presence_penalty=1.5, frequency_penalty=0.7),
    "negative_presence": SamplingParams(presence_penalty=-2.0, frequency_penalty=-0.5),
    "logit_bias": SamplingParams(logit_bias={5: 7.5, 11: -100.0, 40: 0.25}),
    "min_tokens": SamplingParams(min_tokens=9, stop_token_ids=[9]),
    "bad_words": SamplingParams(bad_words_token_ids=[[7], [20, 21], [22, 23, 24]]),
    "all": SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4,
                          logit_bias={2: 3.0}, min_tokens=9, bad_words_token_ids=[[21, 22]]),
}


def test_each_processor_matches_transformers_in_a_mixed_batch():
    """One batch: a row per case plus untouched rows; each edited row equals the transformers
    processors' output on the same scores and tokens, the others are left bit for bit."""
    gen = torch.Generator().manual_seed(0)
    rows, expected = [], []
    for i, params in enumerate([SamplingParams(), *CASES.values(), SamplingParams(temperature=0)]):
        prompt = torch.randint(0, VOCAB, (12,), generator=gen).tolist() + [20, 21, 22, 23]
        output = torch.randint(0, VOCAB, (4 + i % 3,), generator=gen).tolist() + [20, 22, 23]
        rows.append(History(prompt, output, params))
    logits = torch.randn(len(rows), VOCAB, generator=gen) * 3
    for row, hist in zip(logits, rows):
        ids = torch.tensor([hist.all_token_ids])
        expected.append(hf_processors(hist.sampling_params, len(hist.prompt_token_ids), EOS)(ids, row[None].clone())[0])
    edited = logits.clone()
    apply_logits_processors(edited, rows, {EOS})
    for name, got, want, hist in zip(["none", *CASES, "greedy"], edited, expected, rows):
        assert torch.allclose(got, want, atol=1e-5, equal_nan=True), name
        changed = not torch.equal(got, logits[rows.index(hist)])
        assert changed == hist.sampling_params.has_logits_processors, name


def test_min_tokens_counts_generated_tokens_only():
    logits = torch.zeros(2, VOCAB)
    rows = [History([1] * 10, [4] * 4, SamplingParams(min_tokens=5, stop_token_ids=[9])),
            History([1] * 10, [4] * 5, SamplingParams(min_tokens=5, stop_token_ids=[9]))]
    apply_logits_processors(logits, rows, {EOS})
    assert logits[0, EOS] == float("-inf") and logits[0, 9] == float("-inf")
    assert torch.all(logits[1] == 0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("pen"), "llama", seed=3)


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(str(model_path), num_kv_blocks=256)


PROMPT = [40, 41, 42, 43, 44, 45, 100, 101, 102, 40, 41, 42]


def _generate(llm, params, prompt=PROMPT):
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_matches_transformers_generate(llm, model_path, case):
    """The engine's greedy tokens with each edit equal transformers' generate() with its
    processors on the same weights, and differ from the plain greedy tokens."""
    reference = load_reference(model_path)
    n = 14
    params = dataclasses.replace(CASES[case], max_tokens=n, temperature=0, ignore_eos=True)
    eos = llm.get_tokenizer().eos_token_id
    procs = hf_processors(params, len(PROMPT), eos)
    with torch.no_grad():
        hf = reference.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, logits_processor=procs,
                                attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                                pad_token_id=0)[0, len(PROMPT):].tolist()
    got = _generate(llm, params)
    assert got == hf
    if case != "min_tokens":  # (only bites when EOS would win early: see the bias test below)
        plain = _generate(llm, dataclasses.replace(params, **{f.name: getattr(SamplingParams(), f.name)
                                                               for f in dataclasses.fields(SamplingParams)
                                                               if f.name in _EDIT_FIELDS}))
        assert got != plain, "the edit should change this greedy output"


_EDIT_FIELDS = {"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                "bad_words_token_ids"}


def test_min_tokens_holds_back_a_favoured_eos(llm):
    eos = llm.get_tokenizer().eos_token_id
    favoured = SamplingParams(max_tokens=10, temperature=0, logit_bias={eos: 100.0})
    assert _generate(llm, favoured) == [eos]
    held = _generate(llm, dataclasses.replace(favoured, min_tokens=4))
    assert len(held) == 5 and eos not in held[:4] and held[4] == eos


def _run(engine, rid, params, output_token_ids=()):
    engine.add_request(rid, PROMPT, params, output_token_ids=list(output_token_ids))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("case", ["all", "presence_frequency", "bad_words", "repetition"])
def test_handover_and_resume_apply_the_same_state(llm, case):
    """Prefill node: the first token (max_tokens=1). Decode node: prompt + first token.
    Failover: prompt + every relayed token. Each continues exactly as one engine would."""
    params = dataclasses.replace(CASES[case], max_tokens=12, temperature=0, ignore_eos=True)
    whole = _run(llm.engine, f"{case}-whole", params)
    first = _run(llm.engine, f"{case}-prefill", dataclasses.replace(params, max_tokens=1))
    assert first == whole[:1]
    assert first + _run(llm.engine, f"{case}-decode", params, first) == whole
    for k in (3, 7):
        assert whole[:k] + _run(llm.engine, f"{case}-resume{k}", params, whole[:k]) == whole


PENALISED = dict(presence_penalty=1.2, frequency_penalty=0.6, logit_bias={"65": 4.0, "120": -100},
                 extra_body={"repetition_penalty": 1.4, "min_tokens": 6, "bad_words": ["e", "th"],
                             "ignore_eos": True, "return_token_ids": True})


@pytest.fixture(scope="module", params=[pytest.param("nixl", marks=pytest.mark.shared_cluster("plain_cluster")),
                                        pytest.param("store", marks=pytest.mark.shared_cluster("store_cluster"))])
def cluster(request):
    """conftest's plain_cluster and store_cluster, whose flags are exactly `--kv-transfer nixl`
    and `--kv-transfer store` with the test defaults (these tests only send requests)."""
    return request.param, request.getfixturevalue({"nixl": "plain_cluster", "store": "store_cluster"}[request.param])


def test_cluster_greedy_with_penalties_matches_offline(cluster):
    mode, url = cluster
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    offline = LLM("builtin:tiny", num_kv_blocks=128)
    tok = offline.get_tokenizer()
    prompt = "The theme of these thoughts: the the the"
    r = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=16, temperature=0, **PENALISED)
    bad = [tok.encode(w, add_special_tokens=False) for w in ("e", " e", "th", " th")]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, presence_penalty=1.2,
                            frequency_penalty=0.6, logit_bias={65: 4.0, 120: -100}, repetition_penalty=1.4,
                            min_tokens=6, bad_words_token_ids=bad)
    want = offline.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    plain = offline.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert r.choices[0].model_extra["token_ids"] == want.token_ids, mode
    assert want.token_ids != plain.token_ids
    assert "e" not in r.choices[0].text and "th" not in r.choices[0].text


@pytest.mark.parametrize("extra", [
    {"presence_penalty": 2.5}, {"frequency_penalty": -2.01}, {"logit_bias": {"5": 101}},
    {"logit_bias": {"999999": 1}}, {"logit_bias": {"abc": 1}}, {"logit_bias": {"\u00b2": 1}}, {"extra_body": {"repetition_penalty": 0}},
    {"extra_body": {"min_tokens": 9}}, {"extra_body": {"bad_words": [""]}}])
def test_out_of_range_values_are_openai_400s(cluster, extra):
    _, url = cluster
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="builtin:tiny", prompt="hi", max_tokens=4, **extra)
    assert err.value.body["type"] == "invalid_request_error" and err.value.body["message"]
