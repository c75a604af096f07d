"""Speculative decoding with an EAGLE-1 head (pdserve.spec_decode.eagle) on random-weight models:
greedy output equal to the engine without speculation and to transformers' generate, batched
with requests that do not speculate, through prefix hits and preemption; and the head's drafts
equal to a plain-torch reference of the head (transformers' LlamaDecoderLayer on the same
weights), so a wrong head fails even though verification keeps the output exact."""
from __future__ import annotations

import pytest
from spec_heads import (
    EagleReference,
    assert_outputs_equal_transformers,
    make_eagle_head,
    make_markov_target_and_copy_head,
    record_drafts,
)
from test_spec_decode import _assert_no_leak, _ids, _prompts

from pdserve import LLM, SamplingParams
from pdserve.testing.model_factory import load_reference, make_model

K = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target = make_model(root, "llama", seed=3)
    return target, make_eagle_head(root, target, seed=5), load_reference(target)


@pytest.fixture(scope="module")
def plain(models):
    return LLM(str(models[0]), block_size=8, num_kv_blocks=96)


def _eagle(target, head, **kw):
    kw.setdefault("num_kv_blocks", 96)
    return LLM(str(target), block_size=8, speculative_config={"method": "eagle", "model": str(head),
                                                              "num_speculative_tokens": K}, **kw)


def test_greedy_equals_plain_engine_and_transformers(models, plain):
    target, head, ref = models
    prompts = _prompts(2, (5, 12, 20, 31))
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    params = [greedy, greedy, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3)]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    want = plain.generate(inputs, params, use_tqdm=False)
    llm = _eagle(target, head)
    seen = record_drafts(llm)
    ours = llm.generate(inputs, params, use_tqdm=False)
    assert _ids(ours) == _ids(want)
    assert_outputs_equal_transformers(ref, prompts[:2], ours[:2], 20)
    assert llm.engine.speculator.stats.num_draft_tokens > 0
    assert seen and {rid for rid, *_ in seen} == {"0", "1", "2"}  # (the penalised request never drafts)
    _assert_no_leak(llm)


def test_drafts_equal_the_torch_reference(models):
    """Every draft of a batch (first steps after the prefill and later ones, after accepted and
    rejected drafts) equals the reference head run over the whole sequence."""
    target, head, ref = models
    llm = _eagle(target, head)
    seen = record_drafts(llm)
    inputs = [{"prompt_token_ids": p} for p in _prompts(6, (7, 19))]
    llm.generate(inputs, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    reference = EagleReference(head, ref)
    assert len(seen) >= 4
    for _, tokens, drafts, offset in seen:
        assert offset == 0
        assert drafts == reference.drafts(tokens, len(drafts))
    _assert_no_leak(llm)


def test_prefix_hits_and_preemption(models, plain):
    """Preemption, then prefix-cache hits (the head's rows start after the hit, as on a decode
    node that got the prompt's KV from a prefill node): output equal to the plain engine's, and
    drafts equal to the reference head over the positions this engine computed."""
    target, head, ref = models
    prompts = [{"prompt_token_ids": p} for p in _prompts(3, (20, 24, 28), repeat=True)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = _ids(plain.generate(prompts, params, use_tqdm=False))
    llm = _eagle(target, head, num_kv_blocks=14)
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == want
    assert llm.engine.scheduler.num_preemptions > 0
    seen = record_drafts(llm)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert _ids(again) == want and any(o.num_cached_tokens for o in again)
    reference = EagleReference(head, ref)
    assert any(offset > 0 for *_, offset in seen)
    for _, tokens, drafts, offset in seen:
        assert drafts == reference.drafts(tokens, len(drafts), offset)
    _assert_no_leak(llm)


def test_own_embedding_and_fc_bias(models, tmp_path):
    target, _, ref = models
    head = make_eagle_head(tmp_path, target, seed=9, own_embedding=True, fc_bias=True)
    llm = _eagle(target, head)
    seen = record_drafts(llm)
    llm.generate({"prompt_token_ids": _prompts(8, (11,))[0]}, SamplingParams(max_tokens=8, temperature=0,
                                                                              ignore_eos=True), use_tqdm=False)
    reference = EagleReference(head, ref)
    assert seen
    for _, tokens, drafts, offset in seen:
        assert drafts == reference.drafts(tokens, len(drafts), offset)


def test_mismatched_head_is_refused(models, tmp_path):
    target, _, _ = models
    other = make_model(tmp_path, "llama", seed=1, hidden_size=32)
    head = make_eagle_head(tmp_path, other, seed=2)
    with pytest.raises(ValueError, match="hidden_size"):
        _eagle(target, head)
    with pytest.raises(ValueError, match="needs a model"):
        LLM(str(target), num_kv_blocks=16, speculative_config={"method": "eagle", "num_speculative_tokens": 2})


def test_a_head_that_copies_the_target_is_accepted(tmp_path):
    """The head computes what a (Markov) target computes: its drafts are all accepted, and the
    output is still the plain engine's."""
    target, head = make_markov_target_and_copy_head(tmp_path)
    inputs = [{"prompt_token_ids": p} for p in _prompts(4, (6, 17))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = _ids(LLM(str(target), block_size=8, num_kv_blocks=96).generate(inputs, params, use_tqdm=False))
    llm = _eagle(target, head)
    assert _ids(llm.generate(inputs, params, use_tqdm=False)) == want
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate == 1.0
    _assert_no_leak(llm)


def test_seeded_sampling_equals_plain(models, plain):
    """Sampled requests verify the head's drafts as any others: seeded output is the plain engine's."""
    target, head, _ = models
    inputs = [{"prompt_token_ids": p} for p in _prompts(4, (10, 21))]
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=s, ignore_eos=True) for s in (7, 8)]
    llm = _eagle(target, head)
    assert _ids(llm.generate(inputs, params, use_tqdm=False)) == _ids(plain.generate(inputs, params, use_tqdm=False))
    assert llm.engine.speculator.stats.num_draft_tokens > 0
    _assert_no_leak(llm)
