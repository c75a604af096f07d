"""The compiled decode step (pdserve.kernels.native_decode) on unquantized float32 checkpoints:
the gemv reads each float32 weight row as it is (bits 32 in native_gemv.c), so Llama, Qwen2 (qkv
bias) and Qwen3 (QK norms) checkpoints in float32 take the compiled step as quantized ones do.
Greedy tokens equal transformers' generate on the same weights, and logprobs are within 1e-4 of
the same engine running the layers in Python, at one request, a few (one pass over the rows) and
more than 8 (the path that multiplies each row into the tokens 8 at a time)."""
from __future__ import annotations

import pytest
from test_native_decode import PROMPTS, compare_with_python_layers

from pdserve import LLM
from pdserve.kernels import native_gemv
from pdserve.testing.model_factory import assert_greedy_matches_reference, load_reference, make_model

pytestmark = pytest.mark.skipif(native_gemv.compiler() is None or native_gemv._why_not() is not None,
                                reason="no C compiler or neither AVX-512 nor AVX2: the compiled kernels are off")


@pytest.fixture(autouse=True)
def _private_cache(private_cache):
    """conftest's: a private PDSERVE_CACHE_DIR sharing the compiled kernels"""


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_float32_checkpoints_take_the_compiled_step(tmp_path, arch):
    path = make_model(tmp_path, arch)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    native = llm.engine.model.native_decode
    assert native is not None, "a float32 checkpoint should take the compiled decode step"
    steps = native.steps
    assert_greedy_matches_reference(llm, load_reference(path), PROMPTS[:3], 16)
    assert native.steps > steps
    compare_with_python_layers(llm, [PROMPTS[0]])  # one row a step
    compare_with_python_layers(llm)  # four rows
    compare_with_python_layers(llm, PROMPTS * 3)  # twelve rows: past 8, each row multiplied 8 tokens at a time


def test_a_bf16_checkpoint_in_float32_reads_bf16_rows(tmp_path):
    """A bf16 checkpoint served in float32 (the directory vLLM serves): every weight is a bf16
    value, so the compiled step reads each matrix as bf16 rows (bits 16, half float32's bytes)
    and widens them exactly. Greedy equals transformers' on the same weights, logprobs within
    1e-4 of the Python layers', at 1, 4 and 12 rows; a float32 checkpoint keeps float32 rows."""
    import torch
    from transformers import AutoModelForCausalLM  # heavy: this test's bf16 copy of the checkpoint

    path = make_model(tmp_path, "llama")
    AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.bfloat16).save_pretrained(path)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    native = llm.engine.model.native_decode
    assert native is not None
    weights = llm.engine.model.native_decode_weights()
    assert {m[2] for layer in weights.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)} == {16}
    steps = native.steps
    assert_greedy_matches_reference(llm, load_reference(path), PROMPTS[:3], 16)
    assert native.steps > steps
    compare_with_python_layers(llm, [PROMPTS[0]])
    compare_with_python_layers(llm)
    compare_with_python_layers(llm, PROMPTS * 3)
    float32 = LLM(str(make_model(tmp_path / "f32", "llama")), dtype="float32", num_kv_blocks=64)
    assert {m[2] for m in (float32.engine.model.native_decode_weights().layers[0].qkv,)} == {32}


def test_a_bfloat16_model_keeps_the_python_layers(tmp_path):
    """Only float32 weights are read as they are: a bfloat16 model's weights are refused."""
    llm = LLM(str(make_model(tmp_path, "llama")), dtype="bfloat16", num_kv_blocks=64)
    assert llm.engine.model.native_decode is None
    assert "neither quantized for the compiled gemv nor float32" in llm.engine.model.native_decode_weights()


def test_rows_that_are_not_whole_blocks_of_32_keep_the_python_layers(tmp_path):
    """The gemv reads 32 columns at a time: a hidden size of 48 is refused at plan time, and the
    model still decodes (through the Python layers)."""
    llm = LLM(str(make_model(tmp_path, "llama", hidden_size=48)), dtype="float32", num_kv_blocks=64)
    assert llm.engine.model.native_decode is None
    assert len(llm.generate([{"prompt_token_ids": [3, 4, 5]}], use_tqdm=False)[0].outputs[0].token_ids) > 0


@pytest.mark.parametrize("hidden,heads,head_dim", [(256, 16, 64), (448, 14, 64), (384, 6, 128), (256, 4, 256)])
def test_query_groups_taken_in_register_sized_parts(tmp_path, hidden, heads, head_dim):
    """Attention holds up to 4 query heads of 64 (2 of 128, 1 of 256) in registers: groups of 8,
    7 (4 + 3), 3 heads of 128 (2 + 1) and 2 of 256 run in parts, each part its own queries, scores
    and outputs. Twelve
    rows over 2 KV heads make the step parallel over whole groups (sequence, KV head)."""
    path = make_model(tmp_path, "llama", hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=2,
                      head_dim=head_dim)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    assert llm.engine.model.native_decode is not None
    assert_greedy_matches_reference(llm, load_reference(path), PROMPTS[:3], 16)
    compare_with_python_layers(llm, PROMPTS * 3)
