"""Loading errors name what is supported or what is missing; dtypes; the built-in model."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.models.loader import SUPPORTED_ARCHITECTURES, ModelLoadError
from pdserve.testing.model_factory import make_model


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    path = make_model(tmp_path, "llama")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        LLM(model=str(path))
    assert "GPTNeoXForCausalLM" in str(err.value)
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model=str(tmp_path / "nowhere"))
    sharded = make_model(tmp_path, "qwen2", max_shard_size="100KB")
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        LLM(model=str(sharded))
    no_config = tmp_path / "no-config"
    shutil.copytree(make_model(tmp_path / "x", "llama"), no_config)
    (no_config / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(model=str(no_config))


def test_bfloat16_on_cpu_runs_close_to_float32(tmp_path):
    path = make_model(tmp_path, "llama")
    prompt = list(range(5, 40))
    f32 = LLM(model=str(path), num_kv_blocks=16).engine.prompt_logits(prompt)
    bf16 = LLM(model=str(path), num_kv_blocks=16, dtype="bfloat16").engine.prompt_logits(prompt)
    assert bf16.dtype == torch.float32  # logits are always returned in float32
    assert (f32 - bf16).abs().max() < 0.5 and (f32.argmax(-1) == bf16.argmax(-1)).float().mean() > 0.8


def test_builtin_model_is_deterministic_and_generates_text():
    llm = LLM("builtin:tiny", num_kv_blocks=32)
    out = llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    again = LLM("builtin:tiny", num_kv_blocks=32).generate(
        "Hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
