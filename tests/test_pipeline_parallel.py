"""Pipeline parallelism offline (pdserve.executor with pipeline stages): a PP 2 engine (this
process runs the first stage, a worker process the second) on random-weight checkpoints with an
odd layer count (an uneven split) equals transformers' greedy output in float32, batched, with
prefix-cache hits and with preemption; seeded sampling, prompt logprobs and embeddings equal
PP 1; the KV blocks' bytes and keys do not depend on PP; a lost stage fails the engine's next
step and no worker outlives its driver."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from family_models import NEW_TOKENS, check_offline_greedy, make_family_model, random_prompts, reference_greedy
from family_models import load_reference as load_family_reference

from pdserve import LLM, SamplingParams
from pdserve.cluster.ray_actors import fill_template
from pdserve.engine.config import EngineConfig
from pdserve.engine.embedding import EmbeddingBatch
from pdserve.engine.request import Request
from pdserve.entrypoints.cli import build_parser
from pdserve.entrypoints.launcher import Cluster
from pdserve.entrypoints.ray_launch import node_templates, placement
from pdserve.entrypoints.tp_degrees import node_parallel_flags, pool_ranks
from pdserve.executor.pipeline_runner import split_micro_batches
from pdserve.executor.setup import check_pp_support
from pdserve.models.pipeline import pp_layer_range
from pdserve.testing.model_factory import load_reference, make_deepseek, make_model
from pdserve.testing.worker_checks import assert_lost_worker_fails_the_next_step, assert_workers_die_with_their_driver


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    # Three layers each: stage 0 holds layers 0-1 (with the embedding), stage 1 layer 2 (with
    # the norm and the LM head).
    return {"llama": make_model(root, "llama", num_hidden_layers=3),
            "qwen3_moe": make_family_model(root, "qwen3_moe", num_hidden_layers=3),
            # sliding layers (a 21-token window) and a full one, each with its RoPE table;
            "gemma3_text": make_family_model(root, "gemma3_text"),  # four layers: 0-1, 2-3
            "deepseek_v3": make_deepseek(root, "deepseek_v3")}


def _reference(models, kind):
    return (load_family_reference if kind in ("qwen3_moe", "gemma3_text") else load_reference)(models[kind])


def test_layers_split_as_vllm_does():
    """By count, the remainder one each to the stages before the last (vLLM's get_pp_indices)."""
    assert [pp_layer_range(3, s, 2) for s in range(2)] == [(0, 2), (2, 3)]
    assert [pp_layer_range(20, s, 4) for s in range(4)] == [(0, 5), (5, 10), (10, 15), (15, 20)]
    assert [pp_layer_range(10, s, 4) for s in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        pp_layer_range(2, 0, 3)


def test_what_does_not_run_over_stages_is_refused_with_the_pair_named():
    with pytest.raises(ValueError, match="method mtp: not supported with pipeline_parallel_size > 1"):
        EngineConfig(pipeline_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    EngineConfig(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    from transformers import AutoConfig
    gemma = AutoConfig.for_model("gemma3", architectures=["Gemma3ForConditionalGeneration"])
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration is not split into pipeline stages yet"):
        check_pp_support(gemma, 2)
    llama = AutoConfig.for_model("llama", num_hidden_layers=2, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2 layers"):
        check_pp_support(llama, 3)


def test_pdserve_up_gives_each_node_its_stages():
    """Locally, a comma list cycles over the pool; on Ray, each pool's one degree reaches its
    template, and a node's placement group has a bundle per rank of every stage."""
    local = build_parser().parse_args(["up", "--decode-nodes", "3", "--decode-pp", "1,2", "--decode-tp", "2"])
    assert [node_parallel_flags(local, "decode", i) for i in range(3)] == [
        ["--tensor-parallel-size", "2"], ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"],
        ["--tensor-parallel-size", "2"]]
    assert pool_ranks(local, "decode", 3) == 8
    args = build_parser().parse_args(["up", "--ray", "auto", "--model", "builtin:tiny", "--kv-transfer", "nixl",
                                      "--threads-per-node", "1", "--decode-pp", "2", "--decode-tp", "2"])
    templates = node_templates(args, Cluster(args))
    parsed = [build_parser().parse_args(fill_template([a.replace("{node_id}", f"{r}-0") for a in templates[r]],
                                                      "10.0.0.7", {"control": 5600, "side": 5601}))
              for r in ("prefill", "decode")]
    assert [(n.tensor_parallel_size, n.pipeline_parallel_size) for n in parsed] == [(1, 1), (2, 2)]
    assert placement(args).role_tp == {"prefill": 1, "decode": 4}


def test_a_step_splits_into_micro_batches_of_about_equal_tokens():
    items = [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 30), ("f", 2)]
    assert split_micro_batches(items, 2) == [items[:5], items[5:]]
    assert split_micro_batches(items[:4], 2) == [items[:2], items[2:4]]
    assert split_micro_batches(items[:1], 2) == [items[:1]]


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "deepseek_v3", "gemma3_text"])
def test_pp2_greedy_equals_transformers(models, kind):
    path = models[kind]
    llm = LLM(model=str(path), pipeline_parallel_size=2, num_kv_blocks=9, max_num_batched_tokens=32)
    try:
        model = llm.engine.model
        assert model.pp_layers == (0, 2), "the driver holds the first stage: layers 0 and 1"
        assert model.lm_head is None, "the LM head belongs to the last stage"
        check_offline_greedy(path, _reference(models, kind), llm)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def llama_pp2(models):
    # Built on a thread that ends at once: the workers must outlive the thread that started them
    # (PR_SET_PDEATHSIG follows the forking thread, not the process).
    built: list[LLM] = []
    thread = threading.Thread(target=lambda: built.append(
        LLM(model=str(models["llama"]), pipeline_parallel_size=2, num_kv_blocks=64)))
    thread.start()
    thread.join()
    llm = built[0]
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def llama_pp1(models):
    llm = LLM(model=str(models["llama"]), num_kv_blocks=64)
    yield llm
    llm.close()


def test_pp2_sampling_and_prompt_logprobs_equal_pp1(llama_pp1, llama_pp2):
    """Two steps in flight by default (the first stage computes the next while the last computes
    the one before); one at a time, and a step in two micro-batches, draw the same tokens."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(7, 250, [5, 30, 61])]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True, prompt_logprobs=2)
    want = llama_pp1.generate(prompts, params, use_tqdm=False)
    engine, runner = llama_pp2.engine, llama_pp2.engine.runner
    runner.peak_in_flight = 0
    got = llama_pp2.generate(prompts, params, use_tqdm=False)
    assert runner.peak_in_flight == 2, "a step should be launched before the step before it came back"
    for steps, micro_batches in ((1, 1), (1, 2)):
        runner.steps_in_flight = engine.scheduler.steps_in_flight = steps
        runner.micro_batches, runner.peak_in_flight = micro_batches, 0
        try:
            again = llama_pp2.generate(prompts, params, use_tqdm=False)
        finally:
            runner.steps_in_flight = engine.scheduler.steps_in_flight = 2
            runner.micro_batches = 1
        assert runner.peak_in_flight == 1
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(want, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    prompt = prompts[2]["prompt_token_ids"]
    assert torch.allclose(llama_pp1.engine.prompt_logits(prompt), llama_pp2.engine.prompt_logits(prompt), atol=1e-4)
    assert llama_pp2.engine.pool.num_in_use() == 0


def test_a_request_aborted_while_its_step_is_in_flight_ends_alone(llama_pp1, llama_pp2):
    """Its blocks are freed at once and its row dropped when the step comes back; the others'
    tokens are PP 1's and every block returns."""
    prompts = random_prompts(9, 250, [20, 33, 47, 18])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llama_pp1.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                use_tqdm=False)]
    engine = llama_pp2.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abort-{i}", prompt, params)
    got: dict[str, list[int]] = {f"abort-{i}": [] for i in range(len(prompts))}
    while not engine.launched or engine.launched[0].batch.items[0][0].num_output_tokens < 3:
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    victim = engine.launched[0].batch.items[0][0].request_id
    engine.abort_request(victim)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != victim
            got[out.request_id] += out.new_token_ids
    assert len(got.pop(victim)) == 3
    assert got == {f"abort-{i}": w for i, w in enumerate(want) if f"abort-{i}" != victim}
    assert engine.pool.num_in_use() == 0


def test_pp2_embeddings_equal_pp1(llama_pp1, llama_pp2):
    """Hidden states, no LM head: the last stage sends them back instead of logits."""
    prompts = random_prompts(4, 250, [6, 25])
    vectors = []
    for llm in (llama_pp1, llama_pp2):
        batch = EmbeddingBatch(prompts, "mean")
        while not batch.done:
            assert batch.advance(llm.engine)
        vectors.append(batch.vectors)
    for a, b in zip(*vectors):
        np.testing.assert_allclose(b, a, atol=1e-5)


def test_kv_blocks_and_keys_do_not_depend_on_pp(llama_pp1, llama_pp2):
    """The node's cache holds every layer whatever the stages, so a block computed at PP 2 has
    PP 1's layout and values under PP 1's key: what the store and NIXL hand over, and what a prefix hit
    across nodes of different degrees rests on."""
    prompt = random_prompts(11, 250, [40])[0]
    params = SamplingParams(max_tokens=1, temperature=0)
    blocks = []
    for llm in (llama_pp1, llama_pp2):
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        keys = llm.engine.kv.block_keys(Request("keys", prompt, params))
        blocks.append((keys, [llm.engine.pool.lookup(k) for k in keys], llm.engine.kv_cache))
    (keys1, ids1, cache1), (keys2, ids2, cache2) = blocks
    assert keys1 == keys2 and len(keys1) == len(prompt) // 16
    assert None not in ids1 + ids2, "the prompt's blocks should be cached"
    for b1, b2 in zip(ids1, ids2):
        torch.testing.assert_close(cache2[b2], cache1[b1], atol=1e-5, rtol=0)  # (another thread count)


def test_lost_stage_fails_the_next_step_and_leaves_no_process(llama_pp2):
    assert_lost_worker_fails_the_next_step(llama_pp2)


def test_stages_die_with_their_driver(models):
    assert_workers_die_with_their_driver(str(models['llama']), pipeline_parallel_size=2)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "deepseek_v3"])
def test_pp2_tp2_greedy_equals_transformers(models, kind):
    """Four processes: two stages of two TP ranks each (a light batch: they share two cores); the
    MoE's experts and MLA's latent attention split across ranks within each stage."""
    path = models[kind]
    ref = _reference(models, kind)
    llm = LLM(model=str(path), pipeline_parallel_size=2, tensor_parallel_size=2, num_kv_blocks=32,
              max_num_batched_tokens=32)
    try:
        attn = llm.engine.model.layers[0].self_attn
        heads = attn.spec.num_heads if kind == "deepseek_v3" else attn.num_heads  # MLA keeps its in its spec
        assert heads == ref.config.num_attention_heads // 2
        prompts = random_prompts(8, ref.config.vocab_size, [9, 45])
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == reference_greedy(ref, prompt, NEW_TOKENS)[0]
    finally:
        llm.close()
