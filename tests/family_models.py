"""Random-weight checkpoints of the MoE, Gemma 3 and gpt-oss families, built offline with
transformers exactly as save_pretrained writes them, and the checks that make a token-exact
comparison with transformers meaningful.

Weights use std 0.2 (Gemma 3: 0.1 and untied embeddings; tied, its sqrt(hidden)-scaled
embedding makes greedy repeat one token). Norms, biases, sinks and router biases are
randomised too so every one of them is exercised.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

from pdserve import LLM, SamplingParams
from pdserve.models.builtin import build_byte_tokenizer

NEW_TOKENS = 10

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False)

FAMILIES = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(
        intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, head_dim=32)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=3, shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "mixtral": ("MixtralForCausalLM", dict(intermediate_size=64, num_local_experts=4,
                                           num_experts_per_tok=2)),
    "gemma3_text": ("Gemma3ForCausalLM", dict(
        num_hidden_layers=4, intermediate_size=96, head_dim=32, query_pre_attn_scalar=24,
        sliding_window=21, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                       "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1000000.0}},
        final_logit_softcapping=30.0, initializer_range=0.1)),
    "gpt_oss": ("GptOssForCausalLM", dict(
        num_hidden_layers=3, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        head_dim=16, sliding_window=5, layer_types=["sliding_attention", "full_attention",
                                                    "sliding_attention"],
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 16, "rope_theta": 150000.0,
                         "truncate": False})),
}


def make_family_model(root: Path, kind: str, seed: int = 0, **overrides) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM
    arch, extra = FAMILIES[kind]
    tokenizer = build_byte_tokenizer()
    config = AutoConfig.for_model(kind, **{**BASE, **extra, **overrides}, vocab_size=len(tokenizer),
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=0, architectures=[arch])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gemma = kind == "gemma3_text"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's norms scale by (1 + w); the others by w
                p.normal_(0.0 if gemma else 1.0, 0.2)
            elif name.endswith("bias") or name.endswith("sinks"):
                p.normal_(0.0, 0.5 if name.endswith("sinks") else 0.2)
    path = root / kind
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_reference(path: Path):
    from transformers import AutoConfig, AutoModelForCausalLM
    # gpt-oss's sinks need the eager attention; the others run transformers' sdpa path.
    attn = "eager" if AutoConfig.from_pretrained(str(path)).model_type == "gpt_oss" else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 attn_implementation=attn).eval()
    model.generation_config.eos_token_id = None  # compare with ignore_eos: never stop early
    return model


def random_prompts(seed: int, vocab: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 5) for _ in range(n)] for n in lengths]


def reference_greedy(ref, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and each step's top-2 logit gap."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                           output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    logits = torch.stack([step[0] for step in out.logits])
    top2 = logits.topk(2, dim=-1).values
    return out.sequences[0, len(prompt):].tolist(), top2[:, 0] - top2[:, 1]


def assert_meaningful(tokens: list[int], gaps: torch.Tensor) -> None:
    """A token-exact comparison says something only if greedy has clear winners and does not
    just repeat one token."""
    assert len(set(tokens)) > 2, f"greedy output barely varies: {tokens}"
    assert float(gaps.min()) > 1e-3, f"a top-2 logit gap of {float(gaps.min()):.1e}: a near tie"


def meaningful_greedy(ref, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy tokens for each prompt, each checked meaningful (assert_meaningful)."""
    out = []
    for prompt in prompts:
        tokens, gaps = reference_greedy(ref, prompt, n)
        assert_meaningful(tokens, gaps)
        out.append(tokens)
    return out


def hybrid_handover_bytes(path: Path, prompts: list[list[int]]) -> int:
    """What handing these prompts over moves for a hybrid checkpoint: each prompt's KV blocks and
    its state slot, as an engine of it lays them out (the same at every TP degree)."""
    engine = LLM(model=str(path), num_kv_blocks=8, max_num_seqs=1).engine
    blocks = sum(-(-len(p) // engine.config.block_size) for p in prompts)
    return (blocks * engine.kv_cache[0].numel() * engine.kv_cache.element_size()
            + len(prompts) * engine.kv.states.slot_nbytes)


def check_prompt_logits(path: Path, ref, lengths=(1, 9, 40, 70)) -> None:
    llm = LLM(model=str(path), num_kv_blocks=64)
    for prompt in random_prompts(1, ref.config.vocab_size, lengths):
        ours = llm.engine.prompt_logits(prompt)
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0]
        diff = (ours - theirs).abs().max().item()
        assert diff < 1e-4, f"{path.name}: max |logit diff| {diff:.2e} for a {len(prompt)}-token prompt"


def check_offline_greedy(path: Path, ref, llm: LLM | None = None) -> None:
    """One engine (by default a TP 1 one with 9 blocks and 32-token steps): a batch with chunked
    prefill whose small cache forces preemption, then the same prompts again from the prefix
    cache; every output equals transformers' generate."""
    vocab = ref.config.vocab_size
    base = random_prompts(3, vocab, [40])[0]
    prompts = [base + tail for tail in random_prompts(4, vocab, [3, 11, 20])] + random_prompts(5, vocab, [2, 17])
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    llm = llm or LLM(model=str(path), num_kv_blocks=9, max_num_batched_tokens=32)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the small cache should have forced a preemption"
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert any(o.num_cached_tokens >= 32 for o in again), "the shared prefix was not reused"
    for prompt, a, b in zip(prompts, first, again):
        want, gaps = reference_greedy(ref, prompt, NEW_TOKENS)
        assert_meaningful(want, gaps)
        assert a.outputs[0].token_ids == want, path.name
        assert b.outputs[0].token_ids == want, path.name
    assert llm.engine.pool.num_in_use() == 0, "blocks leaked after all requests finished"


def cuda_path_logits(path: Path, llm: LLM, prompt: list[int], monkeypatch) -> torch.Tensor:
    """The prompt's logits through the model's CUDA kernels: on the GPU where there is one (the
    same checkpoint loaded there in float32), else on CPU with the kernels forced through the
    Triton interpreter, on llm's own model."""
    if torch.cuda.is_available():
        on_gpu = LLM(str(path), num_kv_blocks=64, device="cuda", dtype="float32")
        try:
            return on_gpu.engine.prompt_logits(prompt).cpu()
        finally:
            on_gpu.close()
    from pdserve.layers.quant import cuda_kernels  # the layers' switch to the GPU kernels
    monkeypatch.setattr(cuda_kernels, "runs_triton", lambda t: True)
    return llm.engine.prompt_logits(prompt)


def count_fused_calls(experts_cls, monkeypatch) -> list:
    """A list that grows by one each time experts_cls runs its fused (CUDA) experts path."""
    calls, fused = [], experts_cls._fused

    def counted(self, *args):
        calls.append(type(self).__name__)
        return fused(self, *args)
    monkeypatch.setattr(experts_cls, "_fused", counted)
    return calls
