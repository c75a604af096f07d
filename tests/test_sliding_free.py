"""A model whose every layer slides (Mistral-style `sliding_window`, here 24 tokens over 16-token
blocks) frees each block once it has slid out of the window, and hands over only the window's
blocks. Checked against transformers' generate in float32 for prompts and generations several
windows long: offline (one long generation with its blocks in use bounded, a batch with
preemption, prefix-cache hits through freed blocks), and through `pdserve up` 1P1D over NIXL
and over the store, where the decode node must have received exactly the window's blocks.

The kernels are checked too: blocks before the window are filled with NaN, so any backend that
read one (even masked) would return NaN.
"""
from __future__ import annotations

import concurrent.futures as cf

import openai
import pytest
import torch
from family_models import assert_meaningful, random_prompts, reference_greedy
from test_kernels import DEVICE, fill_sequences, make_cache, packed_qkv

from pdserve import LLM, SamplingParams
from pdserve.engine.kv_cache_manager import SLID_OUT
from pdserve.kernels import get_ops
from pdserve.testing.model_factory import load_reference, make_model
from pdserve.testing.up_cluster import node_stats, running_cluster, wait_for

WINDOW, BLOCK = 24, 16
# Blocks a decoding request holds: the window's W keys span at most ceil(W / bs) + 1 blocks.
MAX_LIVE_BLOCKS = -(-WINDOW // BLOCK) + 1


def dead_blocks(num_tokens: int) -> int:
    """Leading blocks no query from position num_tokens on sees (keys num_tokens-W+1.. only)."""
    return max(num_tokens - WINDOW + 1, 0) // BLOCK


# ------------------------------------------------------------------------------- kernels

def _poison_dead_blocks(tables, k_cache, v_cache, first_live_pos: list[int], block_size: int):
    """Point every table entry wholly before first_live_pos[i] at one NaN-filled spare block.
    (Not block 0: torch's decode reads it, masked, for the slots past a shorter row's blocks.)"""
    used = set(tables.flatten().tolist())
    spare = max(b for b in range(1, k_cache.shape[0]) if b not in used)
    k_cache[spare], v_cache[spare] = float("nan"), float("nan")
    for i, first in enumerate(first_live_pos):
        tables[i, :max(first, 0) // block_size] = spare
    return tables


@pytest.mark.parametrize("backend", ["torch", "numba", "triton"])
def test_kernels_never_read_blocks_before_the_window(backend):
    ops = get_ops(backend)
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, bs, window = 4, 2, 16, 4, 6
    _, k_cache, v_cache = make_cache(40, bs, kv_heads, head_dim, torch.float32, gen)
    # Decode: one query per sequence at position len-1, seeing keys len-W..len-1.
    lens = [3, 9, 17, 30]
    tables, _, _ = fill_sequences(k_cache, v_cache, lens, gen)
    tables = _poison_dead_blocks(tables, k_cache, v_cache, [n - window for n in lens], bs)
    q, _, _ = packed_qkv(len(lens), heads, kv_heads, head_dim, torch.float32, gen)
    out = ops.paged_decode_attention(q, k_cache, v_cache, tables,
                                     torch.tensor(lens, dtype=torch.int32, device=DEVICE), 0.25, window=window)
    assert not out.isnan().any(), f"{backend} decode read a block before the window"
    # Prefill over a cached prefix: the earliest new query (at ctx - q_len) sees from ctx - q_len - W + 1.
    seqs = [(20, 3), (33, 7), (12, 12)]
    tables, ks, vs = fill_sequences(k_cache, v_cache, [c for c, _ in seqs], gen)
    tables = _poison_dead_blocks(tables, k_cache, v_cache, [c - n - window + 1 for c, n in seqs], bs)
    q, k_new, v_new = packed_qkv(sum(n for _, n in seqs), heads, kv_heads, head_dim, torch.float32, gen)
    cu = [0]
    for i, (_, n) in enumerate(seqs):
        k_new[cu[-1]:cu[-1] + n], v_new[cu[-1]:cu[-1] + n] = ks[i][-n:], vs[i][-n:]
        cu.append(cu[-1] + n)
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    out = ops.prefill_attention(q, k_new, v_new, k_cache, v_cache, as_i32(cu), as_i32([c for c, _ in seqs]),
                                tables, 0.25, window=window)
    assert not out.isnan().any(), f"{backend} prefill read a block before the window"


# ------------------------------------------------------------------------------- offline

@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("sliding-free"), "mistral", seed=2, sliding_window=WINDOW)
    return path, load_reference(path)


GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _expect(ref, prompt: list[int], n: int) -> list[int]:
    want, gaps = reference_greedy(ref, prompt, n)
    assert_meaningful(want, gaps)
    return want


def test_long_generation_matches_generate_with_bounded_blocks(mistral):
    """A 40-token prompt and 150 new tokens (about 8 windows): each decode step holds at most
    MAX_LIVE_BLOCKS blocks, the rest went back to the pool."""
    path, ref = mistral
    prompt = random_prompts(1, ref.config.vocab_size, [40])[0]
    want = _expect(ref, prompt, 150)
    llm = LLM(model=str(path), num_kv_blocks=48, max_num_batched_tokens=32)
    engine = llm.engine
    assert engine.kv.window == WINDOW and engine.max_model_len > 4 * WINDOW  # no cap at the window
    engine.add_request("long", prompt, SamplingParams(max_tokens=150, temperature=0, ignore_eos=True))
    tokens, peak = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
        req = engine.get_request("long")
        if req is not None and req.output_token_ids:  # decoding
            live = [b for b in req.block_ids if b != SLID_OUT]
            assert req.block_ids[:req.num_slid_blocks] == [SLID_OUT] * req.num_slid_blocks
            assert req.num_slid_blocks == dead_blocks(req.num_computed_tokens)
            assert engine.pool.num_used == len(live)
            peak = max(peak, len(live))
    assert tokens == want
    assert peak == MAX_LIVE_BLOCKS, f"peak {peak} blocks held while decoding"
    assert engine.pool.num_in_use() == 0


def test_batch_with_preemption_and_prefix_hits_matches_generate(mistral):
    """Four requests in a cache too small for all (preemption), then the same prompts again:
    their prefixes come back from the prefix cache, including blocks that slid out and were
    freed with their keys; every output equals transformers'."""
    path, ref = mistral
    vocab = ref.config.vocab_size
    base = random_prompts(3, vocab, [50])[0]
    prompts = [base + tail for tail in random_prompts(4, vocab, [3, 11, 20])] + random_prompts(5, vocab, [45])
    wants = [_expect(ref, p, GREEDY.max_tokens) for p in prompts]
    small = LLM(model=str(path), num_kv_blocks=9, max_num_batched_tokens=32)
    got = small.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0, "the small cache should have forced a preemption"
    assert [o.outputs[0].token_ids for o in got] == wants
    assert small.engine.pool.num_in_use() == 0

    llm = LLM(model=str(path), num_kv_blocks=64, max_num_batched_tokens=32)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)[0]
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [first.outputs[0].token_ids] + [o.outputs[0].token_ids for o in again] == [wants[0]] + wants
    # Block 0 slid out of the first request's window early; the hit still found it.
    assert again[0].num_cached_tokens == (len(prompts[0]) - 1) // BLOCK * BLOCK
    assert all(o.num_cached_tokens >= 48 for o in again[1:3]), "the shared prefix was not reused"
    assert llm.engine.pool.num_in_use() == 0


def test_landing_kv_gets_only_window_blocks_and_a_failed_landing_recomputes(mistral):
    """A request admitted to wait for 99 tokens of remote KV holds blocks for the window only;
    when that transfer fails, it recomputes from scratch (its skipped blocks never landed) and
    still matches transformers."""
    path, ref = mistral
    prompt = random_prompts(6, ref.config.vocab_size, [100])[0]
    want = _expect(ref, prompt, 20)
    engine = LLM(model=str(path), num_kv_blocks=32).engine
    req = engine.add_request("r", prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                             remote_kv_tokens=len(prompt))
    dead = dead_blocks(len(prompt) - 1)  # the last prompt token is computed here for its logits
    assert req.remote_kv is not None and req.num_slid_blocks == dead > 0
    assert req.block_ids[:dead] == [SLID_OUT] * dead and SLID_OUT not in req.block_ids[dead:]
    assert engine.pool.num_used == -(-(len(prompt) - 1) // BLOCK) - dead
    engine.report_remote_kv("r", ok=False)
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == want
    assert engine.pool.num_in_use() == 0


def test_qwen2_with_full_layers_keeps_every_block_and_matches_generate(tmp_path):
    """Qwen2 with use_sliding_window and max_window_layers=1: layer 0 full, layer 1 sliding.
    The windows are applied (token-exact past the window), and the full layer keeps every
    block: nothing slides out."""
    path = make_model(tmp_path, "qwen2", seed=1, use_sliding_window=True, sliding_window=WINDOW,
                      max_window_layers=1)
    ref = load_reference(path)
    assert ref.config.layer_types == ["full_attention", "sliding_attention"]
    prompt = random_prompts(2, ref.config.vocab_size, [60])[0]
    want = _expect(ref, prompt, 40)
    llm = LLM(model=str(path), num_kv_blocks=32)
    assert llm.engine.kv.window == 0
    assert llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want


# ------------------------------------------------------------------------------- P/D

@pytest.mark.parametrize("transfer", ["nixl", "store"])
def test_pd_moves_only_the_window_and_matches_offline(mistral, transfer):
    path, ref = mistral
    model, vocab = str(path), ref.config.vocab_size
    prompts = random_prompts(11, vocab, [70, 101, 33])
    wants = [_expect(ref, p, 30) for p in prompts]
    offline = LLM(model=model, num_kv_blocks=64)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in offline.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)] == wants
    block_bytes = offline.engine.kv_cache[0].numel() * offline.engine.kv_cache.element_size()
    window_blocks = sum(-(-len(p) // BLOCK) - dead_blocks(len(p)) for p in prompts)
    prompt_blocks = sum(-(-len(p) // BLOCK) for p in prompts)
    with running_cluster("--model", model, "--kv-transfer", transfer, "--num-kv-blocks", "64") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

        def complete(prompt):
            r = client.completions.create(model=model, prompt=prompt, max_tokens=30, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            return r.choices[0].model_extra["token_ids"]

        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(complete, prompts)) == wants, transfer
        wait_for(lambda: node_stats(url)["decode-0"]["transfers_ok"] >= len(prompts))
        decode = node_stats(url)["decode-0"]
        assert decode["transfers_failed"] == 0
        moved = decode[f"transfer_bytes_{transfer}"]
        assert moved == window_blocks * block_bytes, \
            f"moved {moved} bytes; the windows hold {window_blocks} of the prompts' {prompt_blocks} blocks"
        wait_for(lambda: all(n["free_blocks"] == n["total_blocks"] for n in node_stats(url).values()))
