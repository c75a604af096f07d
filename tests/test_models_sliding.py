"""Gemma 3 (sliding and full layers with their own RoPE, post norms, query scaling, soft-capped
logits) and gpt-oss (alternating sliding/full layers, attention sinks, biased clamped-SwiGLU
MoE, yarn RoPE) against transformers in float32: offline, and through a real `pdserve up`
1P1D cluster over NIXL and over the store.

Sliding windows (21 and 5 tokens) are shorter than the prompts, chunks and cached prefixes, so
every path must apply them: a path that attended to the full context would change the logits.
"""
from __future__ import annotations

import openai
import pytest
from family_models import (
    assert_meaningful,
    check_offline_greedy,
    check_prompt_logits,
    load_reference,
    make_family_model,
    random_prompts,
    reference_greedy,
)

from pdserve import LLM, SamplingParams
from pdserve.models.loader import ModelLoadError, load_hf_config
from pdserve.testing.up_cluster import running_cluster


@pytest.fixture(scope="module", params=["gemma3_text", "gpt_oss"])
def checkpoint(request, tmp_path_factory):
    path = make_family_model(tmp_path_factory.mktemp("sliding"), request.param)
    return path, load_reference(path)


def test_prompt_logits_match(checkpoint):
    check_prompt_logits(*checkpoint)


def test_greedy_batched_chunked_cached_and_preempted_match_generate(checkpoint):
    check_offline_greedy(*checkpoint)


@pytest.mark.parametrize("kind, field, value", [("gemma3_text", "attn_logit_softcapping", 50.0),
                                                ("gpt_oss", "layer_types", ["chunked_attention"] * 3)])
def test_unsupported_config_is_refused(tmp_path, kind, field, value):
    path = make_family_model(tmp_path, kind, **{field: value})
    with pytest.raises(ModelLoadError, match=field if field != "layer_types" else "chunked_attention"):
        load_hf_config(path)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = make_family_model(tmp_path_factory.mktemp("pd"), "gpt_oss", seed=1)
    return path, load_reference(path)


@pytest.mark.parametrize("transfer", ["nixl", "store"])
def test_pd_cluster_matches_transformers_and_offline_seeded(gpt_oss, transfer):
    """Prompts longer than a block and the window, a shared prefix (the second request's prefix
    comes from the prefill node's cache), greedy equal to transformers, seeded sampling equal
    to the offline engine."""
    path, ref = gpt_oss
    vocab = ref.config.vocab_size
    base = random_prompts(7, vocab, [37])[0]
    prompts = [base + tail for tail in random_prompts(8, vocab, [4, 13])]
    seeded = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    offline = LLM(model=str(path), num_kv_blocks=64)
    want_seeded = offline.generate([{"prompt_token_ids": prompts[0]}], seeded, use_tqdm=False)[0]
    with running_cluster("--model", str(path), "--kv-transfer", transfer, "--prefill-nodes", "1",
                         "--decode-nodes", "1", "--num-kv-blocks", "64") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        for prompt in prompts:
            want, gaps = reference_greedy(ref, prompt, 10)
            assert_meaningful(want, gaps)
            r = client.completions.create(model=str(path), prompt=prompt, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            assert r.choices[0].model_extra["token_ids"] == want, transfer
        r = client.completions.create(model=str(path), prompt=prompts[0], max_tokens=8, temperature=0.8,
                                      top_p=0.9, seed=11,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == want_seeded.outputs[0].token_ids, transfer
