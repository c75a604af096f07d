"""Speculative decoding (pdserve.spec_decode) on random-weight models: greedy output equal to the
same engine without speculation and to transformers' generate, with n-gram and draft-model
drafts, batched with requests that do not speculate, through prefix hits and preemption; seeded
sampling reproducible; sampled tokens following the target's distribution; no KV block leaks."""
from __future__ import annotations

import random

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.request import RequestStatus
from pdserve.testing.model_factory import load_reference, make_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """The target, and a smaller draft with its vocabulary: the target's first layer alone (so
    it agrees with the target now and then: drafts are both accepted and rejected)."""
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("spec")
    target = make_model(root, "llama", seed=3)
    cut = AutoModelForCausalLM.from_pretrained(target)
    cut.model.layers = cut.model.layers[:1]
    cut.config.num_hidden_layers = 1
    cut.save_pretrained(root / "draft")
    return target, root / "draft"


@pytest.fixture(scope="module")
def plain(paths):
    return _llm(paths[0])


def _llm(path, spec=None, **kw):
    kw.setdefault("num_kv_blocks", 96)
    return LLM(str(path), block_size=8, speculative_config=spec, **kw)


def _prompts(seed, lengths, repeat=False):
    rng = random.Random(seed)
    out = []
    for n in lengths:
        p = [rng.randrange(250) for _ in range(n)]
        out.append(p + p[: n // 2] if repeat else p)  # repeats give the n-gram lookup matches
    return out


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _assert_no_leak(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free == engine.pool.num_blocks
    proposer = engine.speculator.proposer
    if hasattr(proposer, "kv"):
        assert proposer.kv.pool.num_free == proposer.kv.pool.num_blocks and not proposer.shadows


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_equals_plain_engine_and_transformers(paths, plain, method):
    """A batch mixing speculating requests with ones that cannot (a penalty, logprobs, a stop
    string, a short max_tokens): every output equals the engine without speculation, and the
    plain greedy ones equal transformers' generate; drafts were both accepted and rejected."""
    target, draft = paths
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "num_speculative_tokens": 3, "model": str(draft)}
    prompts = _prompts(2, (5, 12, 20, 31), repeat=True)  # (prompts the n-gram lookup gets right at times)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    params = [greedy, greedy, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3)]
    prompts = prompts + [prompts[0]]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    want = plain.generate(inputs, params, use_tqdm=False)
    llm = _llm(target, spec)
    ours = llm.generate(inputs, params, use_tqdm=False)
    assert _ids(ours) == _ids(want)
    for a, b in zip(ours[2].outputs[0].logprobs, want[2].outputs[0].logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    ref = load_reference(target)
    for prompt, out in zip(prompts[:2], ours[:2]):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):]
        assert out.outputs[0].token_ids == want.tolist()
    stats = llm.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    _assert_no_leak(llm)


def test_stop_strings_and_eos_inside_accepted_drafts(paths, plain):
    """The draft model is the target (every draft accepted): a stop token, a stop string and
    max_tokens that fall inside a step's accepted run still end the request at that token."""
    target, _ = paths
    prompt = _prompts(2, (9,))[0]
    base = plain.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=20, temperature=0,
                                                                         ignore_eos=True), use_tqdm=False)
    seq = base[0].outputs[0].token_ids
    text = plain.get_tokenizer().decode(seq[6:8])
    cases = [SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[seq[5]]),
             SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[text]),
             SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]
    llm = _llm(target, {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4})
    for params in cases:
        want = plain.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        got = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        assert len(want.token_ids) > 1
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    _assert_no_leak(llm)


def test_prefix_hits_and_preemption(paths, plain):
    """A cache too small for the batch preempts; the second pass hits the prefix cache: the
    tokens are those of the plain engine under the same pressure, and no block leaks."""
    target, draft = paths
    prompts = [{"prompt_token_ids": p} for p in _prompts(3, (20, 24, 28), repeat=True)]
    params = SamplingParams(max_tokens=28, temperature=0, ignore_eos=True)
    want = _ids(plain.generate(prompts, params, use_tqdm=False))
    llm = _llm(target, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}, num_kv_blocks=14)
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == want
    again = llm.generate(prompts, params, use_tqdm=False)
    assert _ids(again) == want and any(o.num_cached_tokens for o in again)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.speculator.stats.num_accepted_tokens > 0
    _assert_no_leak(llm)


def test_seeded_sampling_is_reproducible_and_equals_plain(paths, plain):
    target, _ = paths
    inputs = [{"prompt_token_ids": p} for p in _prompts(4, (10, 21), repeat=True)]
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=s, ignore_eos=True) for s in (7, 8)]
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3}
    first = _ids(_llm(target, spec).generate(inputs, params, use_tqdm=False))
    assert first == _ids(_llm(target, spec).generate(inputs, params, use_tqdm=False))
    assert first == _ids(plain.generate(inputs, params, use_tqdm=False))


def _sample_first_drafted(engine, prompt, t0, count):
    """count draws of the tokens verified in a request's first step, a one-token decode (the
    prompt's blocks come from the prefix cache, t0 is its output so far), so its rows are
    drafted: output token 1, and token 2 where the draft for token 1 was accepted."""
    firsts: dict[str, list[int]] = {}
    for batch in range(0, count, 150):
        for i in range(150):
            engine.add_request(f"s{batch + i}", prompt, SamplingParams(max_tokens=3, temperature=1.0,
                                                                       ignore_eos=True), output_token_ids=[t0])
        while engine.has_unfinished_requests():
            for out in engine.step():
                firsts[out.request_id] = out.new_token_ids
                if not out.finished:
                    engine.abort_request(out.request_id)
    return list(firsts.values())


def _chi_square_p(counts: dict[int, int], probs: torch.Tensor, n: int) -> float:
    """Pearson's test over the tokens expected at least 5 times, the rest pooled in one bin."""
    big = [t for t in range(len(probs)) if probs[t] * n >= 5]
    observed = [counts.get(t, 0) for t in big] + [n - sum(counts.get(t, 0) for t in big)]
    expected = [float(probs[t]) * n for t in big] + [n * (1 - float(probs[big].sum()))]
    if expected[-1] < 1:
        observed, expected = observed[:-1], expected[:-1]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(observed) - 1  # chi2's survival function is the regularised upper gamma Q(df/2, x/2)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_sampled_tokens_follow_the_target_distribution(paths):
    """Temperature 1 with the target drafting greedily for itself: the verified token at the
    first drafted position follows the target's softmax (chi-square), and so does the next one
    given that the draft was accepted (it was computed on the draft's KV)."""
    target, _ = paths
    llm = _llm(target, {"method": "draft_model", "model": str(target), "num_speculative_tokens": 2},
               num_kv_blocks=600, max_num_seqs=256)
    engine = llm.engine
    prompt = _prompts(5, (16,))[0]  # two full blocks: all cached after the first request
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
    t0 = 17
    n = 600
    pairs = _sample_first_drafted(engine, prompt, t0, n)
    p1 = engine.prompt_logits(prompt + [t0])[-1].softmax(-1)
    draft = int(p1.argmax())
    counts: dict[int, int] = {}
    for first, *_ in pairs:
        counts[first] = counts.get(first, 0) + 1
    assert _chi_square_p(counts, p1, n) > 1e-3
    p2 = engine.prompt_logits(prompt + [t0, draft])[-1].softmax(-1)
    seconds = [pair[1] for pair in pairs if pair[0] == draft]
    assert all(len(pair) == 1 for pair in pairs if pair[0] != draft)
    counts2: dict[int, int] = {}
    for t in seconds:
        counts2[t] = counts2.get(t, 0) + 1
    assert _chi_square_p(counts2, p2, len(seconds)) > 1e-3
    assert engine.speculator.stats.num_accepted_tokens > 0
    _assert_no_leak(llm)


@pytest.mark.parametrize("config, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "unknown method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model"),
    ('{"method": "ngram"', "not JSON"),
])
def test_bad_config_is_refused_at_start(config, message):
    with pytest.raises(ValueError, match=message):
        LLM("builtin:tiny", num_kv_blocks=16, speculative_config=config)


def test_draft_vocabulary_mismatch_is_refused(paths, tmp_path):
    target, _ = paths
    other = make_model(tmp_path, "qwen2", seed=1)  # the byte tokenizer's vocabulary...
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(other)
    cfg.vocab_size += 8  # ... grown: the draft cannot score the target's tokens
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_config(cfg).save_pretrained(other)
    with pytest.raises(ValueError, match="vocabulary"):
        _llm(target, {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2})


def test_request_without_match_decodes_normally(paths, plain):
    target, _ = paths
    llm = _llm(target, {**NGRAM, "prompt_lookup_min": 3})
    prompt = list(range(30))  # no 3-gram repeats until the output makes one
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=3, temperature=0,
                                                                     ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == _ids(plain.generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
        use_tqdm=False))[0]
    assert RequestStatus.FINISHED_LENGTH.finish_reason == out[0].outputs[0].finish_reason
