"""The compiled decode step (pdserve.kernels.native_decode, native_moe.c) on the MoE families in
float32: Qwen3-MoE (QK norms, renormalized top-k weights), Qwen2-MoE (qkv bias, unrenormalized
weights, a dense layer between MoE layers, the shared expert and its sigmoid gate), Mixtral and
gpt-oss (attention sinks, the o bias, a biased router, top k then softmax, biased experts with the
clamped SwiGLU, sliding and full layers).
Greedy tokens equal transformers' generate on the same weights, and logprobs are within 1e-4 of
the same engine running the layers in Python at 1, 4 and 12 rows a step."""
from __future__ import annotations

import pytest
from family_models import load_reference, make_family_model
from test_native_decode import PROMPTS, check_tp2_compiled_step, compare_with_python_layers

from pdserve import LLM
from pdserve.kernels import native_gemv
from pdserve.testing.model_factory import assert_greedy_matches_reference, make_deepseek
from pdserve.testing.model_factory import load_reference as load_deepseek_reference

pytestmark = pytest.mark.skipif(native_gemv.compiler() is None or native_gemv._why_not() is not None,
                                reason="no C compiler or neither AVX-512 nor AVX2: the compiled kernels are off")

# the compiled gemv takes rows of whole 32-column blocks: the shared expert's 48 would be refused;
# gpt-oss's clamp at 0.5 binds on these weights (at its 7.0 no value reaches it)
OVERRIDES = {"qwen2_moe": {"shared_expert_intermediate_size": 64}, "gpt_oss": {"swiglu_limit": 0.5}}


@pytest.fixture(autouse=True)
def _private_cache(private_cache):
    """conftest's: a private PDSERVE_CACHE_DIR sharing the compiled kernels"""


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"])
def test_moe_families_take_the_compiled_step_and_match_transformers(tmp_path, family):
    path = make_family_model(tmp_path, family, **OVERRIDES.get(family, {}))
    check_compiled_step(path, load_reference(path))


def check_compiled_step(path, reference) -> None:
    """The model at path takes the compiled step, its greedy tokens are the reference's, and its
    logprobs are the Python layers' at 1, 4 and 12 rows a step."""
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    native = llm.engine.model.native_decode
    assert native is not None, f"a float32 {path.name} should take the compiled decode step"
    steps = native.steps
    assert_greedy_matches_reference(llm, reference, PROMPTS[:3], 16)
    assert native.steps > steps
    compare_with_python_layers(llm, [PROMPTS[2]])  # one row a step
    compare_with_python_layers(llm)  # four rows
    compare_with_python_layers(llm, PROMPTS * 3)  # twelve rows: most experts get several


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v2"])
def test_deepseek_takes_the_compiled_step_and_matches_transformers(tmp_path, kind):
    """Latent attention (V3: q LoRA, yarn's softmax scale; V2: q whole), interleaved RoPE, the
    dense first layer, and grouped routing (V3: sigmoid scores and a correction bias, two of four
    groups by their best two; V2: softmax, one of two groups by its best), with shared experts."""
    # q LoRA 64: the compiled gemv takes rows of whole 32-column blocks (DEEPSEEK_BASE's 48 are not)
    path = make_deepseek(tmp_path, kind, **({"q_lora_rank": 64} if kind == "deepseek_v3" else {}))
    check_compiled_step(path, load_deepseek_reference(path))


def test_gpt_oss_mxfp4_experts_take_the_compiled_step(tmp_path):
    """gpt-oss's MXFP4 experts as held (two e2m1 codes a byte, a power of two per 32 columns):
    the compiled gemv looks each code up in a register and reads x in the codes' order. Greedy
    tokens equal transformers' on the checkpoint it dequantizes itself, and logprobs the Python
    layers' (pdserve.kernels.mxfp4_cpu) at 1, 4 and 12 rows a step."""
    check_compiled_step(*_mxfp4_gpt_oss(tmp_path))


def _mxfp4_gpt_oss(tmp_path):
    """A gpt-oss checkpoint with MXFP4 experts, and transformers' model of it dequantized."""
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from pdserve.testing.quant_checkpoints import write_mxfp4
    # 64 intermediate columns: two groups of 32, one for each of two ranks
    path = write_mxfp4(make_family_model(tmp_path, "gpt_oss", **OVERRIDES["gpt_oss"], intermediate_size=64))
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager",
                                               quantization_config=Mxfp4Config(dequantize=True)).eval()
    ref.generation_config.eos_token_id = None
    return path, ref


@pytest.mark.parametrize("family,expert_parallel", [
    ("qwen2_moe", False), ("gpt_oss", False), ("gpt_oss_mxfp4", False), ("deepseek_v3", False),
    ("gpt_oss_mxfp4", True), ("deepseek_v3", True)])
def test_tp2_ranks_run_their_expert_shards_in_the_compiled_step(tmp_path, family, expert_parallel):
    """At TP 2 each rank's compiled step runs its heads and its half of every expert's columns
    (and of the shared expert, the dense layers), adds the biases that rank 0 keeps, and sums the
    attention and MLP outputs through the rank group's all-reduce where the shard's hooks would;
    with expert parallelism, its half of the experts whole, each row's choices of the other
    rank's experts adding nothing here. Greedy tokens equal transformers', and logprobs are
    within 1e-4 of one process running the layers in Python."""
    if family == "deepseek_v3":
        path, ref = _deepseek(tmp_path)
    else:
        path, ref = _family(tmp_path, family)
    check_tp2_compiled_step(path, ref, enable_expert_parallel=expert_parallel)


# sizes whose every rank's half is whole blocks of 32 columns (the compiled gemv's unit)
TP2_SIZES = {"qwen2_moe": dict(intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64),
             "gpt_oss": dict(intermediate_size=64)}


def _family(tmp_path, family):
    if family != "gpt_oss_mxfp4":
        path = make_family_model(tmp_path, family, **{**OVERRIDES.get(family, {}), **TP2_SIZES[family]})
        return path, load_reference(path)
    return _mxfp4_gpt_oss(tmp_path)


def _deepseek(tmp_path):
    path = make_deepseek(tmp_path, "deepseek_v3", q_lora_rank=64, intermediate_size=128, moe_intermediate_size=64,
                         v_head_dim=16)
    return path, load_deepseek_reference(path)
