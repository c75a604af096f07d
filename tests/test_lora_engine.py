"""Batched multi-LoRA in the engine against PEFT: greedy tokens per adapter equal
PeftModel.generate's in float32, for one batch that mixes three adapters and the base model,
with prefix-cache hits, with slots swapped LRU (max_loras 1 and 2), and with adapters loaded
and unloaded between and during runs."""
from __future__ import annotations

import random

import pytest
from lora_util import make_adapter, peft_greedy

from pdserve import LLM, LoRARequest, SamplingParams
from pdserve.testing.model_factory import make_model

NEW_TOKENS = 8
BLOCK = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_model(root, "llama")
    adapters = {
        "full": make_adapter(base, root / "full", seed=1, r=8, alpha=16),
        # rslora (alpha / sqrt(r)) on some modules only: the others stay the base's
        "rslora": make_adapter(base, root / "rslora", seed=2, r=4, alpha=8, use_rslora=True,
                               targets=["q_proj", "v_proj", "down_proj"]),
        # per-module rank and alpha, as PEFT's rank_pattern / alpha_pattern give them
        "patterned": make_adapter(base, root / "patterned", seed=3, r=16, alpha=8,
                                  rank_pattern={"k_proj": 2}, alpha_pattern={"up_proj": 64}),
    }
    rng = random.Random(0)
    shared = [rng.randrange(3, 200) for _ in range(2 * BLOCK)]  # two full blocks every prompt shares
    prompts = [shared + [rng.randrange(3, 200) for _ in range(n)] for n in (3, 11)]
    want = {name: peft_greedy(base, path, prompts, NEW_TOKENS) for name, path in adapters.items()}
    want[None] = peft_greedy(base, None, prompts, NEW_TOKENS)
    return base, adapters, prompts, want


def _mixed_batch(adapters, prompts):
    """Every prompt under every adapter and the base model, interleaved in one batch."""
    cases = [(name, i) for i in range(len(prompts)) for name in [*adapters, None]]
    requests = [LoRARequest(name, 1 + list(adapters).index(name), str(adapters[name])) if name else None
                for name, _ in cases]
    return cases, [{"prompt_token_ids": prompts[i]} for _, i in cases], requests


def _check(llm, adapters, prompts, want):
    cases, batch, requests = _mixed_batch(adapters, prompts)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(batch, params, use_tqdm=False, lora_request=requests)
    for (name, i), out in zip(cases, outs):
        assert out.outputs[0].token_ids == want[name][i], f"adapter {name}, prompt {i}"
    return outs


def test_mixed_batch_matches_peft_with_prefix_hits(setup):
    base, adapters, prompts, want = setup
    # the adapters really change the output, each its own way
    assert len({tuple(want[name][0]) for name in want}) == len(want)
    llm = LLM(str(base), block_size=BLOCK, enable_lora=True, max_loras=4, max_lora_rank=16)
    _check(llm, adapters, prompts, want)
    again = _check(llm, adapters, prompts, want)
    # the second run hits the prefix cache of its own adapter's blocks (a shared block would
    # have given another adapter's KV, and other tokens)
    assert all(o.num_cached_tokens >= 2 * BLOCK for o in again)
    assert llm.engine.lora.slot_loads == len(adapters)


@pytest.mark.parametrize("max_loras", [1, 2])
def test_lru_swapping_stays_exact(setup, max_loras):
    base, adapters, prompts, want = setup
    llm = LLM(str(base), block_size=BLOCK, max_loras=max_loras, max_cpu_loras=max_loras, max_lora_rank=16,
              lora_modules={name: str(path) for name, path in adapters.items()})
    _check(llm, adapters, prompts, want)
    _check(llm, adapters, prompts, want)
    assert llm.engine.lora.slot_loads > len(adapters)  # adapters were swapped out and back in
    assert len(llm.engine.lora.resident()) <= max_loras
    assert len(llm.engine.lora.host) <= max_loras
    assert llm.engine.pool.num_in_use() == 0  # no block leaked by a request that waited for a slot


def test_rank_above_max_and_unknown_names_are_refused(setup):
    base, adapters, prompts, _ = setup
    llm = LLM(str(base), block_size=BLOCK, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank 8"):
        llm.engine.add_lora("patterned", str(adapters["patterned"]))
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        llm.engine.add_request("x", prompts[0], SamplingParams(), lora_name="nope")
    with pytest.raises(ValueError, match="adapter_config.json"):
        llm.engine.add_lora("bad", str(base))
    plain = LLM(str(base), block_size=BLOCK)
    with pytest.raises(ValueError, match="LoRA adapters are off"):
        plain.engine.add_request("x", prompts[0], SamplingParams(), lora_name="full")


def test_unload_while_running_finishes_its_requests(setup):
    base, adapters, prompts, want = setup
    llm = LLM(str(base), block_size=BLOCK, max_loras=1, lora_modules={"full": str(adapters["full"])})
    engine = llm.engine
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    engine.add_request("a", prompts[0], params, lora_name="full")
    tokens = [t for out in engine.step() for t in out.new_token_ids]
    assert engine.remove_lora("full")
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        engine.add_request("b", prompts[0], params, lora_name="full")
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == want["full"][0]
    assert engine.lora.host == {} and engine.lora.resident() == []  # dropped once its last request ended
    engine.add_lora("full", str(adapters["rslora"]))  # the name is free again


@pytest.mark.parametrize("items", [[(0, 3), (None, 2), (2, 1), (1, 2), (0, 1)],  # a decode-sized step
                                   [(0, 70), (1, 66), (None, 2), (2, 3)]])  # long runs: part by part
def test_stacked_and_per_run_products_equal_a_per_token_reference(items):
    """The ways a step applies its adapters (pdserve.lora.slots) against a plain-torch loop over
    tokens: a fused layer of two parts, three slots of different ranks, one part left out.
    items: (slot or None, tokens) in row order."""
    import torch

    from pdserve.lora.slots import LoRABatch, LoRALayerSlots
    torch.manual_seed(0)
    batch = LoRABatch()
    layer = LoRALayerSlots(32, [16, 8], 3, 4, batch, torch.float32, torch.device("cpu"))
    adapters = {}
    for slot, rank in enumerate((4, 2, 3)):
        parts = [(torch.randn(rank, 32), torch.randn(16, rank)), None if slot == 1 else
                 (torch.randn(rank, 32), torch.randn(8, rank))]
        layer.load(slot, rank, parts)
        adapters[slot] = parts
    x = torch.randn(sum(n for _, n in items), 32)
    want = torch.zeros(x.shape[0], 24)
    row = 0
    for slot, n in items:
        for t in range(row, row + n):
            for part, cols in zip(adapters.get(slot, []), (slice(0, 16), slice(16, 24))):
                if part is not None:
                    want[t, cols] = part[1] @ (part[0] @ x[t])
        row += n
    batch.set_runs(items)
    assert (batch.token_slots is not None) == (x.shape[0] <= 64)  # small steps of several adapters: stacked
    got = [layer.add(x, torch.zeros(x.shape[0], 24))]
    batch.token_slots = None
    got.append(layer.add(x, torch.zeros(x.shape[0], 24)))
    for y in got:
        assert torch.allclose(y, want, atol=1e-4)
