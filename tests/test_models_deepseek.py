"""DeepSeek-V2/V3 (multi-head latent attention + MoE) against transformers' own forward and
generate on the same random weights (checked with transformers 5.24)."""
from __future__ import annotations

import random

import pytest
import torch
from test_model_vs_transformers import assert_same_or_near_tie

from pdserve import LLM, SamplingParams
from pdserve.testing.model_factory import DEEPSEEK_ARCHS, DEEPSEEK_BASE, load_reference, make_deepseek, reference_greedy

NEW_TOKENS = 12
@pytest.fixture(scope="module", params=list(DEEPSEEK_ARCHS))
def checkpoint(request, tmp_path_factory):
    path = make_deepseek(tmp_path_factory.mktemp("models"), request.param)
    return request.param, path, load_reference(path)


def _prompts(seed: int, vocab: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 5) for _ in range(n)] for n in lengths]


def test_prompt_logits_match(checkpoint):
    kind, path, ref = checkpoint
    llm = LLM(model=str(path), num_kv_blocks=64)
    for prompt in _prompts(1, ref.config.vocab_size, [1, 7, 33, 300]):  # 300 > yarn's original 256
        ours = llm.engine.prompt_logits(prompt)
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0]
        diff = (ours - theirs).abs().max().item()
        assert diff < 1e-4, f"{kind}: max |logit diff| {diff:.2e} for a {len(prompt)}-token prompt"


def test_batched_greedy_matches_generate(checkpoint):
    """Batched, chunked prefill and absorbed decode over the latent cache, against generate."""
    kind, path, ref = checkpoint
    prompts = _prompts(2, ref.config.vocab_size, [1, 15, 17, 40, 90])
    llm = LLM(model=str(path), num_kv_blocks=128, max_num_batched_tokens=32)  # forces chunked prefill
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    texts = set()
    for prompt, out in zip(prompts, outs):
        want, logits = reference_greedy(ref, prompt, NEW_TOKENS)
        gaps = [float(step.topk(2).values.diff().abs()) for step in logits]
        assert min(gaps) > 1e-3, f"{kind}: near-flat logits (top-2 gap {min(gaps):.1e}): weak test model"
        assert_same_or_near_tie(out.outputs[0].token_ids, want, logits)
        texts.add(tuple(out.outputs[0].token_ids))
    assert len(texts) == len(prompts), "greedy output should differ between prompts"
    assert any(len(set(t)) > 3 for t in texts), "greedy output should not repeat one token"


def test_prefix_cache_hits_and_preemption_keep_output(checkpoint):
    """Prefix hits read the prefix's latents back from the cache and expand them; preemption
    recomputes them. Both give the same tokens as the first run."""
    kind, path, ref = checkpoint
    base = _prompts(3, ref.config.vocab_size, [48])[0]
    prompts = [base + tail for tail in _prompts(4, ref.config.vocab_size, [5, 9, 20, 33])]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    llm = LLM(model=str(path), num_kv_blocks=7, max_num_batched_tokens=256)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the small cache should have forced a preemption"
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert any(o.num_cached_tokens >= 48 for o in again), "the shared 48-token prefix was not reused"
    for prompt, a, b in zip(prompts, first, again):
        want, logits = reference_greedy(ref, prompt, NEW_TOKENS)
        assert_same_or_near_tie(a.outputs[0].token_ids, want, logits)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_latent_cache_layout(checkpoint):
    """The paged cache holds kv_lora_rank + qk_rope_head_dim values per token and layer, in one
    plane, and its block keys are salted apart from a K/V-per-head layout of the same sizes."""
    from pdserve.protocol.block_keys import kv_layout_salt
    kind, path, ref = checkpoint
    llm = LLM(model=str(path), num_kv_blocks=8)
    cfg = ref.config
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert tuple(llm.engine.kv_cache.shape) == (8, cfg.num_hidden_layers, 1, 16, 1, latent)
    layout = llm.engine.kv_layout
    assert layout.block_nbytes() == cfg.num_hidden_layers * 16 * latent * 4
    same_sizes_kv = kv_layout_salt(str(path), cfg.num_hidden_layers, 1, latent, "float32", 16)
    assert llm.engine.salt != same_sizes_kv


def test_unusual_configs_are_refused(tmp_path):
    from transformers import AutoConfig

    from pdserve.models.deepseek import check_config
    bad = {
        "num_key_value_heads": (dict(num_key_value_heads=2), "num_key_value_heads"),
        "topk_method": (dict(topk_method="noaux_tc"), "topk_method"),
        "groups": (dict(n_group=3, topk_method="group_limited_greedy"), "whole groups"),
        "quantized": (dict(quantization_config={"quant_method": "fp8"}), "per-tensor FP8.*not supported"),
        "scoring": (dict(scoring_func="sigmoid"), "scoring_func"),
    }
    for overrides, words in bad.values():
        config = AutoConfig.for_model("deepseek_v2", **{**DEEPSEEK_BASE, **overrides}, architectures=["DeepseekV2ForCausalLM"])
        with pytest.raises(ValueError, match=words):
            check_config(config)
    check_config(AutoConfig.for_model("deepseek_v2", **DEEPSEEK_BASE, architectures=["DeepseekV2ForCausalLM"]))
