"""Random-weight Hugging Face checkpoints for tests and benchmarks, built offline with transformers.

Weights use std 0.2 so greedy decoding has clear winners (std 0.02 gives near-flat logits
whose argmax flips under any change in reduction order).
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

from pdserve.models.builtin import build_byte_tokenizer
from pdserve.protocol.sampling_params import SamplingParams

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2)

ARCHS = {
    "llama": ("LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama-tied-llama3rope": ("LlamaForCausalLM", dict(
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-linear-rope": ("LlamaForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                                   rope_theta=50000.0)),
    "mistral": ("MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    # (1 + w) norms: the N(1, 0.2) norm weights below scale by about 2 (benchmarks; the tests'
    # Gemma 3 checkpoints come from tests/family_models.py)
    "gemma3": ("Gemma3ForCausalLM", dict(head_dim=32, query_pre_attn_scalar=32, tie_word_embeddings=False)),
}
# The MoE kinds the benchmarks make with make_model (benchmarks/engine/bench_native_decode.py); the
# tests' MoE checkpoints come from tests/family_models.py, and their dense ones iterate ARCHS.
BENCH_ARCHS = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(head_dim=32, moe_intermediate_size=64, num_experts=8,
                                              num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)),
    "gpt_oss": ("GptOssForCausalLM", dict(head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=64,
                                          tie_word_embeddings=False)),
}


def make_model(root: Path, kind: str, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    # deferred: transformers takes ~1 s to import, and tests import this module at collection
    from transformers import AutoConfig, AutoModelForCausalLM
    arch, extra = {**ARCHS, **BENCH_ARCHS}[kind]
    tokenizer = build_byte_tokenizer()
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                  "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3_text",
                  "Qwen3MoeForCausalLM": "qwen3_moe", "GptOssForCausalLM": "gpt_oss"}[arch]
    config = AutoConfig.for_model(model_type, **{**BASE, **extra, **overrides}, vocab_size=len(tokenizer),
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  architectures=[arch])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # biases and norms default to 0/1; randomise them so they are exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    path = root / kind
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    tokenizer.save_pretrained(path)
    return path


def load_reference(path: Path):
    # deferred: transformers takes ~1 s to import, and tests import this module at collection
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # compare with ignore_eos: never stop early
    return model


def assert_matches_reference(llm, ref, seed: int, lengths: tuple[int, ...], new_tokens: int, tol: float,
                             what: str = "") -> None:
    """Random prompts of the given lengths: pdserve's prompt logits within tol of the transformers
    model ref's, and its greedy tokens equal to ref.generate's (with greedy text that varies, so
    the comparison means something)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(ref.config.vocab_size) for _ in range(n)] for n in lengths]
    for prompt in prompts:
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0]
        diff = (llm.engine.prompt_logits(prompt) - theirs).abs().max().item()
        assert diff < tol, f"{what}: max |logit diff| {diff:.2e}"
    assert_greedy_matches_reference(llm, ref, prompts, new_tokens, what)


def assert_agrees_until_a_near_tie(exact_runs, low_runs, margin: float) -> None:
    """Greedy tokens of a lower-precision run (low_runs) equal the exact run's until their first
    difference, and that only where the exact run's top two logprobs (asked with logprobs >= 2)
    were within margin of each other."""
    for full, low in zip(exact_runs, low_runs):
        for step, (want, got) in enumerate(zip(full.outputs[0].token_ids, low.outputs[0].token_ids)):
            if want != got:
                (_, first), (_, second) = sorted(full.outputs[0].logprobs[step].top, key=lambda t: -t[1])[:2]
                assert first - second < margin
                break


def assert_greedy_matches_reference(llm, ref, prompts: list[list[int]], new_tokens: int, what: str = "") -> None:
    """pdserve's greedy tokens equal the transformers model ref's generate, and vary (so the
    comparison means something)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, ours):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == want, what
        assert len(set(want)) > 1, what


def reference_greedy(ref, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens for prompt, and its logits at each of them."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                           output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [step[0] for step in out.logits]


def save_compressed(model, compressor, src: Path, out: Path) -> Path:
    """Write a compressed-tensors checkpoint (compressor already applied to model) to out, with the
    source directory's tokenizer files."""
    model.save_pretrained(out)
    compressor.update_config(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            (out / name).write_bytes((src / name).read_bytes())
    return out


# DeepSeek-V2/V3: multi-head latent attention and MoE.
DEEPSEEK_BASE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
                     qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2,
                     n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=1024,
                     initializer_range=0.2)
DEEPSEEK_ARCHS = {
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
    # deferred: transformers takes ~1 s to import, and tests import this module at collection
    from transformers import AutoConfig, AutoModelForCausalLM
    arch, extra = DEEPSEEK_ARCHS[kind]
    tokenizer = build_byte_tokenizer()
    config = AutoConfig.for_model(kind, **{**DEEPSEEK_BASE, **extra, **overrides}, vocab_size=len(tokenizer),
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
