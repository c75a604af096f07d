"""The CPU-importable parts of the GPU quantization benchmark (benchmarks/gpu/gpu_quant.py): its
arguments, its place in gpu_suite, and the W4A16 checkpoint it writes, loaded and run on CPU
against transformers on the decompressed weights."""
from __future__ import annotations

import pytest
import torch

from benchmarks.gpu import gpu_quant, gpu_suite
from benchmarks.gpu.gpu_quant_checkpoints import FORMATS, checkpoint


def test_arguments_and_suite_step():
    args = gpu_quant.parse_args(["--out", "x", "--formats", "bf16,w4a16", "--batches", "1,8"])
    assert args.formats == ["bf16", "w4a16"] and args.batches == [1, 8] and args.parts == list(gpu_quant.PARTS)
    assert gpu_quant.parse_args(["--out", "x"]).formats == list(FORMATS)
    with pytest.raises(SystemExit):
        gpu_quant.parse_args(["--out", "x", "--formats", "fp4"])
    assert gpu_suite.STEPS["quant"] is gpu_suite.step_quant and "quant" not in gpu_suite.DEFAULT_STEPS


def test_w4a16_checkpoint_loads_quantized_and_matches_transformers(tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from pdserve import LLM
    from pdserve.layers.quant.grouped import GroupedLinearMethod
    from pdserve.testing.model_factory import assert_matches_reference, make_model
    src = make_model(tmp_path, "llama")
    path = checkpoint(src, "w4a16")
    assert checkpoint(src, "w4a16") == path  # written once
    ref = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64)
    fmt = llm.engine.model.layers[0].mlp.down_proj.quant_method.fmt
    assert isinstance(llm.engine.model.layers[0].mlp.down_proj.quant_method, GroupedLinearMethod)
    assert (fmt.bits, fmt.group) == (4, 32)
    assert_matches_reference(llm, ref, 2, (6, 19), 8, 1e-3, "w4a16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through compiled Triton: gpu_quant's exact part runs the real thing")
@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-channel"])
def test_model_through_the_cuda_path_matches_the_cpu_path(fmt, tmp_path, monkeypatch):
    """gpu_quant's exactness check, here: the whole model's greedy tokens with every FP8 layer on
    the CUDA path (the Triton kernel under the interpreter; _scaled_mm on CPU) equal the CPU path's."""
    if fmt == "fp8-channel":
        pytest.importorskip("compressed_tensors")
    from pdserve import LLM, SamplingParams
    from pdserve.layers.quant import cuda_kernels
    from pdserve.testing.model_factory import make_model
    llm = LLM(str(checkpoint(make_model(tmp_path, "llama"), fmt)), dtype="float32", device="cpu", num_kv_blocks=64)
    prompts = [{"prompt_token_ids": [5, 9, 33, 70, 12, 8, 100]}, {"prompt_token_ids": list(range(3, 40))}]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    calls = []
    fp8_apply = cuda_kernels.fp8_apply
    monkeypatch.setattr(cuda_kernels, "runs_triton", lambda x: True)
    monkeypatch.setattr(cuda_kernels, "fp8_apply", lambda *a: calls.append(1) or fp8_apply(*a))
    cuda_path = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert calls and cuda_path == cpu
