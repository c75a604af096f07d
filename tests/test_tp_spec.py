"""Speculative decoding at TP 2 (and at PP 2, n-gram and draft-model drafts): the verify step (a request's last token and its drafts as
decode rows) runs over both ranks like any step, the proposer runs on the driver. Greedy output
equals transformers' generate in float32 for draft-model, EAGLE-1 and DeepSeek MTP drafts
(n-gram drafts: tests/test_feature_matrix.py); a draft model's drafts equal its own greedy continuation in transformers
(its KV is right after the steps the step-down leaves undrafted); an EAGLE head's and an MTP layer's drafts equal
their plain-torch references (so the whole embedding and LM head the driver reads for the head
at TP 2 are the target's); no KV block is left in use."""
from __future__ import annotations

import pytest
import torch
from spec_heads import (
    EagleReference,
    MtpReference,
    add_mtp_layer,
    assert_outputs_equal_transformers,
    make_eagle_head,
    record_drafts,
)
from test_spec_decode import _assert_no_leak, _prompts

from pdserve import LLM, SamplingParams
from pdserve.testing.model_factory import load_reference, make_deepseek, make_model

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A Llama target, a one-layer draft cut from it (it agrees with the target at times) and an
    EAGLE head."""
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("tp_spec")
    target = make_model(root, "llama", seed=3)
    cut = AutoModelForCausalLM.from_pretrained(target)
    cut.model.layers = cut.model.layers[:1]
    cut.config.num_hidden_layers = 1
    cut.save_pretrained(root / "draft")
    return target, root / "draft", make_eagle_head(root, target, seed=5), load_reference(target)


def _run(path, spec, prompts, **kw):
    kw = {"tensor_parallel_size": 2, **kw}
    llm = LLM(str(path), block_size=8, num_kv_blocks=64, speculative_config=spec, **kw)
    seen = record_drafts(llm) if spec["method"] in ("eagle", "mtp") else _record_plain(llm)
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.engine.speculator.stats
        assert stats.num_draft_tokens > 0
        _assert_no_leak(llm)
        return outs, seen, stats
    finally:
        llm.close()


def _record_plain(llm) -> list[tuple[list[int], list[int]]]:
    """Every (request's tokens, drafts) a draft model proposes."""
    proposer, seen = llm.engine.speculator.proposer, []
    propose = proposer.propose_batch

    def recording(wanted):
        drafts = propose(wanted)
        seen.extend((list(req.all_token_ids), d) for (req, _), d in zip(wanted, drafts) if d)
        return drafts
    proposer.propose_batch = recording
    return seen


def _assert_draft_model_drafts(draft, seen) -> None:
    """Each draft is the draft model's greedy continuation of the request's tokens: its KV, kept
    across steps (some without drafts, where the step-down cut them), is right."""
    ref = load_reference(draft)
    assert seen
    for tokens, drafts in seen:
        want = ref.generate(torch.tensor([tokens]), max_new_tokens=len(drafts), do_sample=False)[0, len(tokens):]
        assert drafts == want.tolist()


@pytest.mark.parametrize("method", ["draft_model", "eagle"])  # (n-gram at TP 2: tests/test_feature_matrix.py)
def test_tp2_speculation_equals_transformers(llama, method):
    target, draft, head, ref = llama
    spec = {"method": method, "num_speculative_tokens": 3, "model": str(draft if method == "draft_model" else head)}
    prompts = _prompts(2, (6, 14, 25))
    outs, seen, stats = _run(target, spec, prompts)
    assert_outputs_equal_transformers(ref, prompts, outs, NEW_TOKENS)
    if method == "draft_model":
        _assert_draft_model_drafts(draft, seen)
    if method == "eagle":
        reference = EagleReference(head, ref)
        for _, tokens, drafts, offset in seen:
            assert drafts == reference.drafts(tokens, len(drafts), offset)


def test_tp2_mtp_equals_transformers(tmp_path):
    path = make_deepseek(tmp_path, "deepseek_v3", seed=2)
    add_mtp_layer(path, seed=7)
    ref = load_reference(path)
    prompts = _prompts(2, (6, 15))
    outs, seen, _ = _run(path, {"method": "mtp", "num_speculative_tokens": 2}, prompts)
    assert_outputs_equal_transformers(ref, prompts, outs, NEW_TOKENS)
    reference = MtpReference(path, ref)
    assert seen
    for _, tokens, drafts, offset in seen:
        assert drafts == reference.drafts(tokens, len(drafts), offset)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_pp2_speculation_equals_transformers(llama, method):
    """At PP 2 the verify step's rows (a request's last token and its drafts) pass through both
    stages as any step's; the proposer runs on the driver. EAGLE and MTP heads read the target's
    hidden states, which the last stage holds: refused, with the pair named."""
    target, draft, head, ref = llama
    spec = {"method": method, "num_speculative_tokens": 3,
            **({"model": str(draft)} if method == "draft_model" else {"prompt_lookup_min": 1, "prompt_lookup_max": 3})}
    prompts = _prompts(2, (6, 14, 25))
    outs, seen, _ = _run(target, spec, prompts, tensor_parallel_size=1, pipeline_parallel_size=2)
    assert_outputs_equal_transformers(ref, prompts, outs, NEW_TOKENS)
    if method == "draft_model":
        _assert_draft_model_drafts(draft, seen)
    with pytest.raises(ValueError, match="eagle: not supported with pipeline_parallel_size"):
        LLM(str(target), pipeline_parallel_size=2, speculative_config={"method": "eagle", "model": str(head),
                                                                        "num_speculative_tokens": 3})
