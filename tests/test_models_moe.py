"""Qwen3-MoE, Qwen2-MoE (shared expert, a dense layer) and Mixtral in pdserve's offline engine
against transformers' forward and generate on the same random weights, in float32."""
from __future__ import annotations

import pytest
import torch
from family_models import assert_meaningful, load_reference, make_family_model, random_prompts, reference_greedy

from pdserve import LLM, SamplingParams
from pdserve.models.loader import ModelLoadError, load_hf_config

NEW_TOKENS = 10


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral"])
def checkpoint(request, tmp_path_factory):
    path = make_family_model(tmp_path_factory.mktemp("moe"), request.param)
    return request.param, path, load_reference(path)


def test_prompt_logits_match(checkpoint):
    kind, path, ref = checkpoint
    llm = LLM(model=str(path), num_kv_blocks=64)
    for prompt in random_prompts(1, ref.config.vocab_size, [1, 9, 40]):
        ours = llm.engine.prompt_logits(prompt)
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0]
        diff = (ours - theirs).abs().max().item()
        assert diff < 1e-4, f"{kind}: max |logit diff| {diff:.2e} for a {len(prompt)}-token prompt"


def test_greedy_batched_chunked_cached_and_preempted_match_generate(checkpoint):
    """One engine: a batch with chunked prefill whose small cache forces preemption, then the
    same prompts again from the prefix cache; every output equals transformers' generate."""
    kind, path, ref = checkpoint
    vocab = ref.config.vocab_size
    base = random_prompts(3, vocab, [40])[0]
    prompts = [base + tail for tail in random_prompts(4, vocab, [3, 11, 20])] + random_prompts(5, vocab, [2, 17])
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    llm = LLM(model=str(path), num_kv_blocks=9, max_num_batched_tokens=32)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the small cache should have forced a preemption"
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert any(o.num_cached_tokens >= 32 for o in again), "the shared prefix was not reused"
    for prompt, a, b in zip(prompts, first, again):
        want, gaps = reference_greedy(ref, prompt, NEW_TOKENS)
        assert_meaningful(want, gaps)
        assert a.outputs[0].token_ids == want, kind
        assert b.outputs[0].token_ids == want, kind
    assert llm.engine.pool.num_in_use() == 0, "blocks leaked after all requests finished"


def test_unsupported_config_is_refused(tmp_path):
    path = make_family_model(tmp_path, "qwen3_moe", hidden_act="gelu")
    with pytest.raises(ModelLoadError, match="hidden_act"):
        load_hf_config(path)
