"""Speculative decoding with DeepSeek-V3's MTP layer (pdserve.spec_decode.mtp) on a random-weight
DeepSeek-V3 checkpoint with num_nextn_predict_layers = 1 (the MTP layer's weights written next
to transformers' checkpoint): greedy output equal to the engine without speculation and to
transformers' generate, batched with a request that does not speculate; the layer's drafts equal
a plain-torch reference (transformers' DeepseekV3DecoderLayer on the same weights), after
prefix hits too; a checkpoint without the layer is refused."""
from __future__ import annotations

import pytest
from spec_heads import MtpReference, add_mtp_layer, assert_outputs_equal_transformers, record_drafts
from test_spec_decode import _assert_no_leak, _ids, _prompts

from pdserve import LLM, SamplingParams
from pdserve.testing.model_factory import load_reference, make_deepseek

MTP = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    plain_dir = make_deepseek(root / "plain", "deepseek_v3", seed=2)
    path = make_deepseek(root, "deepseek_v3", seed=2)
    add_mtp_layer(path, seed=7)
    return path, plain_dir, load_reference(path)


def _llm(path, spec=None, **kw):
    kw.setdefault("num_kv_blocks", 64)
    return LLM(str(path), block_size=8, speculative_config=spec, **kw)


def test_greedy_equals_plain_engine_and_transformers_and_drafts_the_reference(models):
    path, _, ref = models
    prompts = _prompts(2, (6, 15, 23))
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    params = [greedy, greedy, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, repetition_penalty=1.2)]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    want = _llm(path).generate(inputs, params, use_tqdm=False)
    llm = _llm(path, MTP)
    seen = record_drafts(llm)
    ours = llm.generate(inputs, params, use_tqdm=False)
    assert _ids(ours) == _ids(want)
    assert_outputs_equal_transformers(ref, prompts[:2], ours[:2], 10)
    reference = MtpReference(path, ref)
    assert {rid for rid, *_ in seen} == {"0", "1"}
    for _, tokens, drafts, offset in seen:
        assert drafts == reference.drafts(tokens, len(drafts), offset)
    _assert_no_leak(llm)


def test_prefix_hits_draft_over_the_computed_positions(models):
    """A second pass hits the prefix cache (as a decode node gets a prompt's KV from a prefill
    node): the layer drafts over the positions this engine computed, as the reference does."""
    path, _, ref = models
    inputs = [{"prompt_token_ids": p} for p in _prompts(5, (19, 26))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = _llm(path, MTP)
    first = _ids(llm.generate(inputs, params, use_tqdm=False))
    seen = record_drafts(llm)
    again = llm.generate(inputs, params, use_tqdm=False)
    assert _ids(again) == first and all(o.num_cached_tokens for o in again)
    reference = MtpReference(path, ref)
    assert seen and all(offset > 0 for *_, offset in seen)
    for _, tokens, drafts, offset in seen:
        assert drafts == reference.drafts(tokens, len(drafts), offset)
    _assert_no_leak(llm)


def test_checkpoint_without_mtp_layer_is_refused(models):
    _, plain_dir, _ = models
    with pytest.raises(ValueError, match="no MTP layer"):
        _llm(plain_dir, MTP)


def test_mtp_and_eagle_refuse_the_other_family(models, tmp_path):
    path, _, _ = models
    with pytest.raises(ValueError, match="DeepSeek-V3 targets"):
        LLM("builtin:tiny", num_kv_blocks=16, speculative_config=MTP)
    from spec_heads import make_eagle_head

    from pdserve.models.builtin import ensure_builtin_model
    head = make_eagle_head(tmp_path, ensure_builtin_model("builtin:tiny"))
    with pytest.raises(ValueError, match="Llama-family targets"):
        _llm(path, {"method": "eagle", "model": str(head), "num_speculative_tokens": 2})
