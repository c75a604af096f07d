"""gpt-oss MXFP4 checkpoints (quant_method mxfp4: each expert projection as `*_blocks` of FP4
e2m1 values and `*_scales` of per-32 powers of two), written here from a random gpt-oss. pdserve
keeps the experts packed: its greedy tokens must be transformers' on the same checkpoint, which
transformers dequantizes to float32 itself (Mxfp4Config(dequantize=True))."""
from __future__ import annotations

import json

import pytest
import torch
from family_models import (
    check_prompt_logits,
    count_fused_calls,
    cuda_path_logits,
    make_family_model,
    random_prompts,
    reference_greedy,
)

from pdserve import LLM, SamplingParams
from pdserve.models.loader import ModelLoadError
from pdserve.models.moe_quant import Mxfp4Experts
from pdserve.testing.quant_checkpoints import write_mxfp4


def mxfp4_checkpoint(root, **shape):
    return write_mxfp4(make_family_model(root, "gpt_oss", seed=1, hidden_size=64, **shape))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # 64 intermediate columns: two groups of 32, one for each of two ranks
    return mxfp4_checkpoint(tmp_path_factory.mktemp("mxfp4"), intermediate_size=64)


def test_mxfp4_experts_match_transformers_dequantized(checkpoint):
    from transformers import AutoModelForCausalLM, Mxfp4Config
    ref = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager",
                                               quantization_config=Mxfp4Config(dequantize=True)).eval()
    ref.generation_config.eos_token_id = None
    check_prompt_logits(checkpoint, ref, lengths=(1, 9, 40))
    llm = LLM(str(checkpoint), num_kv_blocks=64)
    experts = llm.engine.model.layers[0].mlp.experts
    assert isinstance(experts, Mxfp4Experts) and experts.gate_up_proj.dtype == torch.uint8
    assert experts.down_proj.shape[-1] * 2 == ref.config.intermediate_size  # two codes a byte
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for prompt in random_prompts(2, ref.config.vocab_size, [5, 23]):
        want, _ = reference_greedy(ref, prompt, 12)
        assert llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids == want
        assert len(set(want)) > 1


def test_the_cuda_path_gives_the_cpu_paths_logits(checkpoint, monkeypatch):
    """gpt-oss's MXFP4 experts through their CUDA kernel (two grouped GEMMs that unpack codes and
    scales in registers; forced on CPU under the Triton interpreter where no GPU is) against the
    CPU kernel."""
    llm = LLM(str(checkpoint), num_kv_blocks=64, device="cpu")  # the CPU kernels, also where a GPU is
    fused_calls = count_fused_calls(Mxfp4Experts, monkeypatch)
    prompt = [(5 * i) % 150 + 3 for i in range(19)]
    cpu = llm.engine.prompt_logits(prompt)
    assert not fused_calls
    cuda = cuda_path_logits(checkpoint, llm, prompt, monkeypatch)
    assert fused_calls
    assert (cuda - cpu).abs().max().item() < 1e-4 * cpu.abs().max().item()


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp-in-experts", "expert-parallel"])
def test_tp2_keeps_the_experts_packed_and_matches_transformers(checkpoint, expert_parallel):
    """At TP 2 each rank holds half of every expert's intermediate columns (two codes a byte,
    a scale per 32) or half of the experts whole, still packed: the greedy tokens are still
    transformers' on the dequantized checkpoint."""
    from transformers import AutoModelForCausalLM, Mxfp4Config
    ref = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager",
                                               quantization_config=Mxfp4Config(dequantize=True)).eval()
    ref.generation_config.eos_token_id = None
    llm = LLM(str(checkpoint), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, num_kv_blocks=32)
    try:
        experts = llm.engine.model.layers[0].mlp.experts
        cfg = ref.config
        assert isinstance(experts, Mxfp4Experts) and experts.gate_up_proj.dtype == torch.uint8
        if expert_parallel:
            assert experts.gate_up_proj.shape[0] == cfg.num_local_experts // 2
        else:
            assert experts.down_proj.shape[-1] * 2 == cfg.intermediate_size // 2
            assert experts.down_scale.shape[-1] * 32 == cfg.intermediate_size // 2
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        for prompt in random_prompts(2, cfg.vocab_size, [5, 23]):
            want, _ = reference_greedy(ref, prompt, 12)
            assert llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids == want
    finally:
        llm.close()


def test_a_split_inside_a_group_of_32_is_refused(tmp_path):
    src = mxfp4_checkpoint(tmp_path, intermediate_size=32)  # 16 columns a rank
    with pytest.raises(ValueError, match="needs whole groups of 32"):
        LLM(str(src), tensor_parallel_size=2, num_kv_blocks=8)


def test_other_quantization_of_gpt_oss_is_refused(checkpoint, tmp_path):
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for f in checkpoint.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    with pytest.raises(ModelLoadError, match="quant_method 'awq' is not supported for gpt-oss; supported: mxfp4"):
        LLM(str(tmp_path), num_kv_blocks=8)
