"""Tensor parallelism offline (pdserve.executor): a TP 2 engine (this process and one worker
process) on random-weight checkpoints equals transformers' greedy output in float32, batched,
with prefix-cache hits and with preemption; seeded sampling and prompt logprobs equal TP 1; a
lost worker fails the engine's next step instead of hanging, and no worker outlives its driver."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from family_models import NEW_TOKENS, check_offline_greedy, make_family_model, random_prompts, reference_greedy
from family_models import load_reference as load_family_reference

from pdserve import LLM, SamplingParams
from pdserve.engine.embedding import EmbeddingBatch, pool
from pdserve.executor.setup import check_tp_support
from pdserve.testing.model_factory import load_reference, make_deepseek, make_model
from pdserve.testing.model_factory import load_reference as load_deepseek_reference
from pdserve.testing.worker_checks import assert_lost_worker_fails_the_next_step, assert_workers_die_with_their_driver


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    # Fewer KV heads than ranks: the one KV head is replicated on both ranks.
    return {"llama": make_model(root, "llama", num_key_value_heads=1),
            "qwen3": make_model(root, "qwen3"),
            "qwen3_moe": make_family_model(root, "qwen3_moe"),
            "gpt_oss": make_family_model(root, "gpt_oss"),
            "deepseek_v3": make_deepseek(root, "deepseek_v3")}


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_tp2_greedy_equals_transformers(models, kind):
    llm = LLM(model=str(models[kind]), tensor_parallel_size=2, num_kv_blocks=9, max_num_batched_tokens=32)
    try:
        shard = llm.engine.model.layers[0].self_attn
        assert shard.num_heads == 2, "each rank should hold half of the 4 query heads"
        check_offline_greedy(models[kind], load_reference(models[kind]), llm)
    finally:
        llm.close()


def test_tp2_embeddings_equal_transformers_and_keep_the_workers_in_step(models):
    """Embeddings (hidden states, no LM head) at TP 2: the workers run the same forward pass, so
    the pooled vectors equal transformers' and the generation after them is still exact."""
    path = models["llama"]
    ref = load_reference(path)
    llm = LLM(model=str(path), tensor_parallel_size=2, num_kv_blocks=32)
    try:
        prompts = random_prompts(6, ref.config.vocab_size, [7, 30])
        batch = EmbeddingBatch(prompts, "mean")
        while not batch.done:
            assert batch.advance(llm.engine)
        for prompt, vector in zip(prompts, batch.vectors):
            with torch.no_grad():
                want = pool(ref.model(torch.tensor([prompt])).last_hidden_state[0], "mean")
            np.testing.assert_allclose(vector, want, atol=1e-5)
        assert llm.engine.pool.num_in_use() == 0
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference_greedy(ref, prompts[0], NEW_TOKENS)[0]
    finally:
        llm.close()


def test_tp4_greedy_equals_transformers(models):
    """One query head per rank, the one KV head replicated on all four (a lighter batch: four
    processes share the two cores)."""
    path = models["llama"]
    ref = load_reference(path)
    llm = LLM(model=str(path), tensor_parallel_size=4, num_kv_blocks=32, max_num_batched_tokens=32)
    try:
        assert llm.engine.model.layers[0].self_attn.num_heads == 1
        prompts = random_prompts(8, ref.config.vocab_size, [9, 45])
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == reference_greedy(ref, prompt, NEW_TOKENS)[0]
    finally:
        llm.close()


@pytest.mark.parametrize("kind,expert_parallel", [("qwen3_moe", False), ("qwen3_moe", True), ("gpt_oss", False),
                                                  ("deepseek_v3", True)],
                         ids=["qwen3-moe-tp-in-experts", "qwen3-moe-expert-parallel", "gpt-oss-sinks-windows",
                              "deepseek-v3-mla-expert-parallel"])
def test_tp2_moe_greedy_equals_transformers(models, kind, expert_parallel):
    path = models[kind]
    ref = load_deepseek_reference(path) if kind == "deepseek_v3" else load_family_reference(path)
    llm = LLM(model=str(path), tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              num_kv_blocks=9, max_num_batched_tokens=32)
    try:
        cfg = ref.config
        experts = llm.engine.model.layers[-1].mlp.experts
        total = getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None) or cfg.num_local_experts
        intermediate = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        if expert_parallel:  # half of the experts, whole
            assert (experts.num_experts, experts.intermediate) == (total // 2, intermediate)
        else:  # every expert, half of its intermediate rows
            assert (experts.num_experts, experts.intermediate) == (total, intermediate // 2)
        check_offline_greedy(path, ref, llm)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def llama_tp2(models):
    # Built on a thread that ends at once: the workers must outlive the thread that started them
    # (PR_SET_PDEATHSIG follows the forking thread, not the process).
    built: list[LLM] = []
    thread = threading.Thread(target=lambda: built.append(
        LLM(model=str(models["llama"]), tensor_parallel_size=2, num_kv_blocks=64)))
    thread.start()
    thread.join()
    llm = built[0]
    yield llm
    llm.close()


def test_tp2_sampling_and_prompt_logprobs_equal_tp1(models, llama_tp2):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(7, 250, [5, 30, 61])]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True, prompt_logprobs=2)
    tp1 = LLM(model=str(models["llama"]), num_kv_blocks=64)
    want = tp1.generate(prompts, params, use_tqdm=False)
    got = llama_tp2.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    # The step inputs by broadcast (the fallback for steps too big for the shared buffer).
    llama_tp2.engine.executor.channel.shm = False
    again = llama_tp2.generate(prompts, params, use_tqdm=False)
    llama_tp2.engine.executor.channel.shm = True
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in want]
    # Every prompt position's logits agree (within float32 rounding of another reduction order).
    prompt = prompts[2]["prompt_token_ids"]
    assert torch.allclose(tp1.engine.prompt_logits(prompt), llama_tp2.engine.prompt_logits(prompt), atol=1e-4)


def test_lost_worker_fails_the_next_step_and_leaves_no_process(llama_tp2):
    assert_lost_worker_fails_the_next_step(llama_tp2)


def test_workers_die_with_their_driver(models):
    assert_workers_die_with_their_driver(str(models['llama']), tensor_parallel_size=2)


def test_unconverted_family_is_refused_clearly():
    from transformers import AutoConfig
    config = AutoConfig.for_model("gemma3", architectures=["Gemma3ForConditionalGeneration"])
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration is not converted to tensor parallelism yet"):
        check_tp_support(config, 2)
    config = AutoConfig.for_model("llama", hidden_size=48, num_attention_heads=6, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="does not divide the 6 attention heads"):
        check_tp_support(config, 4)
