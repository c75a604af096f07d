"""Hybrid families (Qwen3.5's Gated DeltaNet beside gated attention; Qwen3-Next's, with MoE;
Nemotron-H's Mamba2, attention, MLP and MoE blocks; Granite 4.0-H's, with its multipliers;
Falcon-H1's Mamba2 and attention side by side in every layer, with its muP multipliers)
against transformers in float32, offline: prompt logits, and greedy tokens through chunked
prefill, batched decode of different lengths, slot reuse and preemption by recompute. The
recurrent state lives in a pool of slots beside the KV blocks: none may leak after finishing,
aborting or preempting.

Prompts are longer than the delta rule's chunk (64) and Mamba2's chunk_size (32 here), and the
steps (32 tokens) cut them across chunks, so every path must carry the state exactly.
"""
from __future__ import annotations

import re

import pytest
import torch
from family_models import assert_meaningful, random_prompts, reference_greedy
from hybrid_refusals import DOC, FEATURES, hybrid_section, refusal, refused

from pdserve import LLM, SamplingParams
from pdserve.engine.request import RequestStatus
from pdserve.models.loader import ModelLoadError, load_hf_config
from pdserve.protocol.block_keys import block_key_chain
from pdserve.testing.hybrid_checkpoints import load_reference, make_hybrid_model

KINDS = ["qwen3_5_text", "qwen3_next", "nemotron_h", "granitemoehybrid", "falcon_h1"]
# The checks of the pool and the refusals do not depend on the family: one of each state kind
# (the delta rule's, Mamba2's) and of each place for it (instead of a layer's KV, or beside it in
# the same layer: Falcon-H1).
ONE_OF_EACH = pytest.mark.parametrize("checkpoint", ["qwen3_5_text", "nemotron_h", "falcon_h1"], indirect=True)
# (seed 0's reference greedy has a near tie on a prompt below: a top-2 gap of 5e-4)
SEEDS = {"qwen3_next": 1, "granitemoehybrid": 3}
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
    path = make_hybrid_model(tmp_path_factory.mktemp("hybrid"), request.param, seed=SEEDS.get(request.param, 0))
    return path, load_reference(path)


def test_prompt_logits_match(checkpoint):
    """Within 1e-4 of transformers' float32 logits, or, where transformers' float32 is itself
    farther than that from its float64 model (the delta rule's chunked form over large decays, a
    150-token prompt: 2e-4), within twice that distance: the compiled chunk rounds otherwise than
    torch's ops (and lands nearer the float64 logits)."""
    from transformers import AutoModelForCausalLM
    path, ref = checkpoint
    # float64 (MoE experts in their eager loop: torch's grouped matmul takes no float64)
    exact = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64, experts_implementation="eager").eval()
    llm = LLM(model=str(path), num_kv_blocks=32, enable_prefix_caching=False)
    for prompt in random_prompts(1, ref.config.vocab_size, (1, 9, 150)):
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0]
            float32_error = (exact(torch.tensor([prompt])).logits[0] - theirs.double()).abs().max().item()
        bound = max(1e-4, 2 * float32_error)
        diff = (llm.engine.prompt_logits(prompt) - theirs).abs().max().item()
        assert diff < bound, f"{path.name}: max |logit diff| {diff:.2e} for a {len(prompt)}-token prompt"


@pytest.mark.parametrize("norm", [dict(mamba_rms_norm=False), dict(mamba_norm_before_gate=True)])
def test_falcon_h1_mamba_output_variants_match(tmp_path, norm):
    """Falcon-H1's Mamba output gated without the norm, and normed before the gate (the
    checkpoint above gates, then norms)."""
    path = make_hybrid_model(tmp_path, "falcon_h1", **norm)
    ref = load_reference(path)
    llm = LLM(model=str(path), num_kv_blocks=32, enable_prefix_caching=False)
    prompt = random_prompts(1, ref.config.vocab_size, (70,))[0]
    with torch.no_grad():
        theirs = ref(torch.tensor([prompt])).logits[0]
    assert (llm.engine.prompt_logits(prompt) - theirs).abs().max().item() < 1e-4


def test_greedy_chunked_batched_preempted_match_generate(checkpoint):
    """Three slots for six requests (slots reused), 32-token steps (prompts of 70 and 100 split
    across steps and chunks), and a cache small enough to preempt."""
    path, ref = checkpoint
    prompts = random_prompts(2, ref.config.vocab_size, (70, 100, 3, 17, 1, 45))
    llm = LLM(model=str(path), num_kv_blocks=10, max_num_batched_tokens=32, max_num_seqs=3,
              enable_prefix_caching=False)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the small cache should have forced a preemption"
    for prompt, out in zip(prompts, outs):
        want, gaps = reference_greedy(ref, prompt, NEW_TOKENS)
        assert_meaningful(want, gaps)
        assert out.outputs[0].token_ids == want, f"{path.name}: a {len(prompt)}-token prompt"
    assert llm.engine.pool.num_in_use() == 0, "blocks leaked"
    assert llm.engine.kv.states.num_in_use() == 0, "state slots leaked"


@ONE_OF_EACH
def test_prefix_cache_takes_kv_and_the_state_snapshot(checkpoint):
    """A prompt that shares a block-aligned prefix with an earlier one takes its KV blocks and the
    state snapshotted at the boundary (32-token steps end on block boundaries; decode passes one
    every 16 tokens): the same tokens as transformers, and cached_tokens says so."""
    path, ref = checkpoint
    base = random_prompts(5, ref.config.vocab_size, (40,))[0]
    # the second computes only 4 tokens past the cached 32: its tokens hang on the restored state
    prompts = [base + tail for tail in random_prompts(6, ref.config.vocab_size, (7,))] + [base[:36]]
    llm = LLM(model=str(path), num_kv_blocks=32, max_num_batched_tokens=32, max_num_seqs=2)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
    assert outs[1].num_cached_tokens == 32, "the second prompt should take the first's two shared blocks"
    # a conversation's next turn: the first prompt, its reply (decode left a snapshot at 48), more
    prompts.append(prompts[0] + outs[0].outputs[0].token_ids + [5, 6, 7])
    outs.append(llm.generate([{"prompt_token_ids": prompts[-1]}], params, use_tqdm=False)[0])
    assert outs[2].num_cached_tokens == 48, "the next turn should take the blocks up to the reply's boundary"
    for prompt, out in zip(prompts, outs):
        want, gaps = reference_greedy(ref, prompt, NEW_TOKENS)
        assert_meaningful(want, gaps)
        assert out.outputs[0].token_ids == want, f"{path.name}: a {len(prompt)}-token prompt"
    assert llm.engine.kv.states.num_in_use() == 0, "state slots leaked"


@ONE_OF_EACH
def test_abort_and_preemption_free_state_slots(checkpoint):
    path, ref = checkpoint
    llm = LLM(model=str(path), num_kv_blocks=32, max_num_seqs=2, enable_prefix_caching=False)
    engine, states = llm.engine, llm.engine.kv.states
    assert states.state[0].dtype == torch.float32, "the recurrent state is float32 by default"
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(3, ref.config.vocab_size, (40, 5, 9))):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()
    assert states.num_in_use() == 2, "two running requests, two slots (max_num_seqs)"
    victim = engine.scheduler.running[-1]
    engine.scheduler.running.remove(victim)
    engine.scheduler._preempt(victim)
    assert victim.state_slot is None and states.num_in_use() == 1
    for rid in ("r0", "r1", "r2"):
        engine.abort_request(rid)
    assert states.num_in_use() == 0 and engine.pool.num_in_use() == 0


def _run(engine, rid: str) -> list[int]:
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() if out.request_id == rid for t in out.new_token_ids]
    return tokens


def _hand_over(prefill, decode, prompt: list[int], cached: list[int] = (), with_state: bool = True) -> list[int]:
    """What a P/D pair does, with the transport left out: the prefill engine computes the prompt
    and holds its blocks and state slot; the decode engine takes the prompt (its own prefix cache
    first) into landing blocks and a slot, the rest is copied in, and it decodes."""
    first = _run_held(prefill, prompt)
    held = prefill.scheduler.held["r"]
    req = decode.add_request("r", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
                             output_token_ids=first, remote_kv_tokens=len(prompt))
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req.state_slot is not None
    assert req.num_computed_tokens == len(cached) * decode.config.block_size
    for i in range(len(cached), -(-len(prompt) // decode.config.block_size)):
        decode.kv_cache[req.block_ids[i]] = prefill.kv_cache[held.block_ids[i]]
    if with_state:
        decode.kv.states.arena[req.state_slot] = prefill.kv.states.arena[held.state_slot]
    decode.report_remote_kv("r", True)
    prefill.release_blocks("r")
    return first + _run(decode, "r")


def _run_held(prefill, prompt: list[int]) -> list[int]:
    prefill.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), hold_blocks=True)
    return _run(prefill, "r")


@ONE_OF_EACH
def test_handover_takes_blocks_and_state_into_another_engine(checkpoint):
    """A decode engine continues a prompt another engine computed from its blocks and its state
    slot landed in its own (what NIXL and the store move between nodes): transformers' tokens.
    Without the state, or with the decode engine's own cached prefix and snapshot under the
    landed rest, the same; with the state left out, not."""
    path, ref = checkpoint
    prompt = random_prompts(4, ref.config.vocab_size, (37,))[0]
    want, gaps = reference_greedy(ref, prompt, NEW_TOKENS)
    assert_meaningful(want, gaps)
    prefill, decode = (LLM(model=str(path), num_kv_blocks=32, max_num_seqs=2, max_num_batched_tokens=32).engine
                       for _ in range(2))
    assert _hand_over(prefill, decode, prompt) == want
    assert _hand_over(prefill, decode, prompt, with_state=False) != want, "the state should matter"
    landed = _hand_over(prefill, decode, prompt[:32])  # block-aligned: the landed state is snapshotted
    assert block_key_chain(prompt[:32], 16, decode.salt)[-1] in decode.kv.snapshots
    assert landed == reference_greedy(ref, prompt[:32], NEW_TOKENS)[0]
    # the decode engine's cache holds the first 32 tokens (two blocks and the snapshot after them)
    warm = LLM(model=str(path), num_kv_blocks=32, max_num_seqs=2, max_num_batched_tokens=32).engine
    warm.add_request("w", prompt[:33], SamplingParams(max_tokens=1, ignore_eos=True))
    _run(warm, "w")
    assert _hand_over(prefill, warm, prompt, cached=[0, 1]) == want
    for engine in (prefill, decode, warm):
        assert engine.kv.states.num_in_use() == 0 and engine.pool.num_in_use() == 0, "slots or blocks leaked"


@ONE_OF_EACH
def test_failed_handover_recomputes_from_the_cached_snapshot(checkpoint):
    """A landing that fails (its state never came) recomputes past the decode engine's own cached
    prefix from that prefix's snapshot: transformers' tokens."""
    path, ref = checkpoint
    prompt = random_prompts(4, ref.config.vocab_size, (37,))[0]
    want, _ = reference_greedy(ref, prompt, NEW_TOKENS)
    decode = LLM(model=str(path), num_kv_blocks=32, max_num_seqs=2, max_num_batched_tokens=32).engine
    decode.add_request("w", prompt[:33], SamplingParams(max_tokens=1, ignore_eos=True))
    _run(decode, "w")
    req = decode.add_request("r", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
                             output_token_ids=want[:1], remote_kv_tokens=len(prompt))
    assert req.num_computed_tokens == 32
    decode.kv.states.arena[req.state_slot] = 7  # a READ that wrote part of the slot, then failed
    decode.report_remote_kv("r", False)
    assert want[:1] + _run(decode, "r") == want
    assert decode.kv.states.num_in_use() == 0


@ONE_OF_EACH
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_unsupported_features_are_refused_at_start(checkpoint, feature):
    """Each refusal the feature-matrix page lists (hybrid_refusals) is what the engine says."""
    path, _ = checkpoint
    arch = load_hf_config(path).architectures[0]
    if not refused(feature, arch):
        pytest.skip(f"{arch} runs {feature} (tests/test_hybrid_tp.py)")
    with pytest.raises(ValueError, match=re.escape(refusal(feature, arch))):
        LLM(model=str(path), num_kv_blocks=32, **FEATURES[feature])
    assert hybrid_section() in DOC.read_text(), "docs/feature-matrix.md: regenerate its hybrid section"


@ONE_OF_EACH
def test_state_pool_counts_in_the_memory_budget(checkpoint):
    path, _ = checkpoint
    with pytest.raises(ValueError, match="state pool"):
        LLM(model=str(path), kv_cache_memory_gb=1e-4, max_num_seqs=64, enable_prefix_caching=False)
    budget = LLM(model=str(path), kv_cache_memory_gb=0.01, max_num_seqs=64, enable_prefix_caching=False).engine
    state_bytes = 64 * sum(t[0].numel() * t.element_size() for t in (*budget.kv.states.conv, *budget.kv.states.state))
    block_bytes = budget.kv_layout.block_nbytes()
    assert budget.pool.num_blocks * block_bytes + state_bytes <= 0.01 * 2**30
    assert (budget.pool.num_blocks + 1) * block_bytes + state_bytes > 0.01 * 2**30 - block_bytes


@pytest.mark.parametrize("kind, field, value", [
    ("qwen3_5_text", "hidden_act", "gelu"),
    ("qwen3_5_text", "layer_types", ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
    ("nemotron_h", "moe_latent_size", 16),
    ("nemotron_h", "mlp_hidden_act", "silu"),
    ("nemotron_h", "time_step_limit", (0.0, 1.0)),
    ("granitemoehybrid", "hidden_act", "gelu"),
    ("falcon_h1", "projectors_bias", True),
    ("falcon_h1", "time_step_limit", (0.0, 1.0)),
])
def test_unsupported_variant_is_refused(tmp_path, kind, field, value):
    path = make_hybrid_model(tmp_path, kind, **{field: value})
    with pytest.raises(ModelLoadError, match=field if field != "layer_types" else "sliding_attention"):
        load_hf_config(path)


def test_state_dtype_follows_mamba_ssm_cache_dtype(tmp_path):
    path = make_hybrid_model(tmp_path, "nemotron_h", mamba_ssm_cache_dtype="bfloat16")
    states = LLM(model=str(path), num_kv_blocks=8, max_num_seqs=2, enable_prefix_caching=False).engine.kv.states
    assert {t.dtype for t in states.state} == {torch.bfloat16}
    assert {t.dtype for t in states.conv} == {torch.float32}, "the window keeps the model's dtype"
