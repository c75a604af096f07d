"""LoRA adapters at TP 2 against PEFT: each rank holds its slice of every adapter (a
column-parallel layer's B by output rows, the one KV head's rows on both ranks; a row-parallel
layer's A by input columns, its partial deltas summed by the layer's all-reduce), the worker
loads each adapter into the slot the driver does, and greedy tokens per adapter equal
PeftModel.generate's in float32: one batch mixing two adapters and the base model (the stacked
decode products) and a long prompt (the per-run, per-part products); the same at PP 2, and
through `pdserve up` with TP 2 nodes and n-gram speculation."""
from __future__ import annotations

import json
import random

import pytest
from lora_util import make_adapter, peft_greedy

from pdserve import LLM, LoRARequest, SamplingParams
from pdserve.testing.model_factory import make_model

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_lora")
    # One KV head for two ranks: k_proj's and v_proj's B rows are replicated, not split.
    base = make_model(root, "llama", num_key_value_heads=1)
    adapters = {"full": make_adapter(base, root / "full", seed=1, r=8, alpha=16),
                "some": make_adapter(base, root / "some", seed=2, r=4, alpha=8,
                                     targets=["k_proj", "v_proj", "o_proj", "down_proj"])}
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 13, 70)]
    want = {name: peft_greedy(base, path, prompts, NEW_TOKENS) for name, path in adapters.items()}
    want[None] = peft_greedy(base, None, prompts, NEW_TOKENS)
    assert len({tuple(w[0]) for w in want.values()}) == len(want), "each adapter should change the output"
    return base, adapters, prompts, want


def _check(llm, adapters, prompts, want) -> None:
    cases = [(name, i) for i in range(len(prompts)) for name in [*adapters, None]]
    requests = [LoRARequest(name, 1 + list(adapters).index(name), str(adapters[name])) if name else None
                for name, _ in cases]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for _, i in cases], params, use_tqdm=False,
                        lora_request=requests)
    for (name, i), out in zip(cases, outs):
        assert out.outputs[0].token_ids == want[name][i], f"adapter {name}, prompt {i}"


def test_tp2_lora_equals_peft(setup):
    """(Slots swapped LRU at TP 2, one slot for two adapters: tests/test_feature_matrix.py.)"""
    base, adapters, prompts, want = setup
    llm = LLM(str(base), tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8,
              num_kv_blocks=64)
    try:
        assert llm.engine.model.layers[0].self_attn.qkv_proj.lora.a_stack.shape[0] == 64  # q/k/v: whole input
        assert llm.engine.model.layers[0].mlp.down_proj.lora.a_stack.shape[0] == 64  # half of 128 columns
        _check(llm, adapters, prompts, want)
        assert llm.engine.pool.num_in_use() == 0
    finally:
        llm.close()


def test_pp2_lora_equals_peft(setup):
    """Pipeline stages: each stage's ranks hold the adapters' slices of its layers, and each
    micro-batch's plan names its rows' slots."""
    base, adapters, prompts, want = setup
    llm = LLM(str(base), pipeline_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64)
    try:
        _check(llm, adapters, prompts, want)
        assert llm.engine.pool.num_in_use() == 0
    finally:
        llm.close()


def test_pdserve_up_at_tp2_serves_adapters_with_speculation(setup):
    """Through `pdserve up`: TP 2 prefill and decode nodes with an adapter and n-gram speculation
    on the decode node; each completion (the adapter's and the base model's) equals PEFT's."""
    import openai

    from pdserve.testing.up_cluster import running_cluster
    base, adapters, prompts, want = setup
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    flags = ("--model", str(base), "--prefill-tp", "2", "--decode-tp", "2", "--max-lora-rank", "8",
             "--lora-modules", f"full={adapters['full']}", "--speculative-config", spec)
    with running_cluster(*flags, timeout_s=300) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        for model, name in (("full", "full"), (str(base), None)):
            for prompt, expected in zip(prompts, want[name]):
                r = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True, "return_token_ids": True})
                assert r.choices[0].model_extra["token_ids"] == expected, (model, prompt)
