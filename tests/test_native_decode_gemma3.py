"""The compiled decode step (pdserve.kernels.native_decode) on Gemma 3 (float32): the attention
and MLP outputs RMS-normed before the residual, the GELU (tanh) gate, (1 + w) norms, QK norms,
the query_pre_attn_scalar scale, and each layer's own RoPE table and window (sliding layers: the
default table and a window of 21 tokens; the full layer: a linearly scaled table). Greedy tokens
equal transformers' generate on the same weights, and logprobs are within 1e-4 of the same engine
running the layers in Python at 1, 4 and 12 rows a step."""
from __future__ import annotations

import pytest
from family_models import load_reference, make_family_model
from test_native_decode import PROMPTS, check_tp2_compiled_step, compare_with_python_layers

from pdserve import LLM
from pdserve.kernels import native_gemv
from pdserve.testing.model_factory import assert_greedy_matches_reference

pytestmark = pytest.mark.skipif(native_gemv.compiler() is None or native_gemv._why_not() is not None,
                                reason="no C compiler or neither AVX-512 nor AVX2: the compiled kernels are off")


@pytest.fixture(autouse=True)
def _private_cache(private_cache):
    """conftest's: a private PDSERVE_CACHE_DIR sharing the compiled kernels"""


def test_gemma3_takes_the_compiled_step_and_matches_transformers(tmp_path):
    path = make_family_model(tmp_path, "gemma3_text")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    native = llm.engine.model.native_decode
    assert native is not None, "a float32 Gemma 3 should take the compiled decode step"
    assert native.rope_tables == 2  # the sliding layers' table and the full layer's
    steps = native.steps
    assert_greedy_matches_reference(llm, load_reference(path), PROMPTS[:3], 16)
    assert native.steps > steps
    compare_with_python_layers(llm, [PROMPTS[2]])  # one row a step, past the window
    compare_with_python_layers(llm)  # four rows
    compare_with_python_layers(llm, PROMPTS * 3)  # twelve rows


def test_gemma3_tp2_ranks_take_the_compiled_step(tmp_path):
    """At TP 2 each rank's C step runs its heads and its half of the MLP, and sums the attention
    and MLP outputs through the rank group's all-reduce before their output norms, as the shard's
    hooks do. Greedy tokens equal transformers', logprobs one process's Python layers'."""
    path = make_family_model(tmp_path, "gemma3_text", intermediate_size=128)  # 64 columns a rank
    check_tp2_compiled_step(path, load_reference(path))
