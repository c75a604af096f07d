"""DeepSeek-V2/V3 (multi-head latent attention + MoE) against transformers' own forward and
generate on the same random weights (checked with transformers 5.24)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from model_factory import load_reference
from test_model_vs_transformers import assert_same_or_near_tie, reference_greedy

from pdserve import LLM, SamplingParams
from pdserve.models.builtin import build_byte_tokenizer

NEW_TOKENS = 12
MLA = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
           qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2,
           n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=1024,
           initializer_range=0.2)
KINDS = {
    # V3: q LoRA, sigmoid grouped routing with a correction bias, yarn RoPE with both mscales
    # (cos/sin and the softmax scale), interleaved RoPE.
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(
        q_lora_rank=48, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 0.707})),
    # V2: no q LoRA (as V2-Lite), softmax group-limited routing, complex (interleaved) RoPE.
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(
        q_lora_rank=None, n_group=2, topk_group=1, topk_method="group_limited_greedy",
        routed_scaling_factor=1.5)),
}


def make_deepseek(root: Path, kind: str, seed: int = 0, **overrides) -> Path:
    """A random-weight checkpoint written by transformers (std 0.2, norms and the routing
    correction bias randomised too, so every weight is exercised)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    arch, extra = KINDS[kind]
    tokenizer = build_byte_tokenizer()
    config = AutoConfig.for_model(kind, **{**MLA, **extra, **overrides}, vocab_size=len(tokenizer),
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  architectures=[arch])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.05)
    path = root / kind
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(KINDS))
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
        config = AutoConfig.for_model("deepseek_v2", **{**MLA, **overrides}, architectures=["DeepseekV2ForCausalLM"])
        with pytest.raises(ValueError, match=words):
            check_config(config)
    check_config(AutoConfig.for_model("deepseek_v2", **MLA, architectures=["DeepseekV2ForCausalLM"]))
