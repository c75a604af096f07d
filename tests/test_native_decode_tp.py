"""The compiled decode step (pdserve.kernels.native_decode) at tensor_parallel_size 2: every rank
runs its shard's layers in one C call (its heads, its intermediate slice), and the o and down
products' partial sums go through the rank group's all-reduce, called back from C. Greedy tokens
equal transformers' on the dequantized GGUF, and logprobs are within 1e-4 of one process running
the layers in Python; with LoRA adapters, greedy tokens equal PEFT's. Dropping the all-reduce
from the C step fails the first test (checked by breaking native_decode.c)."""
from __future__ import annotations

import copy

import gguf
import pytest
from lora_util import peft_greedy_of
from test_gguf import reference
from test_native_decode import PROMPTS, _llm, logprobs, pytestmark  # noqa: F401
from test_native_decode_lora import NEW_TOKENS, _generate
from test_native_decode_lora import PROMPTS as LORA_PROMPTS

from pdserve.lora.request import LoRARequest
from pdserve.testing.lora_adapters import adapter_of
from pdserve.testing.model_factory import assert_greedy_matches_reference

Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def _private_cache(private_cache):
    """conftest's: a private PDSERVE_CACHE_DIR sharing the compiled kernels"""


def test_tp2_ranks_take_the_compiled_step(tmp_path):
    llm, path = _llm(tmp_path, tensor_parallel_size=2)
    try:
        native = llm.engine.model.native_decode
        assert native is not None and native.weights.tp_group is not None
        assert native.weights.heads * 2 == llm.engine.model.spec.num_heads  # the rank's shard
        _, ref = reference(path)
        steps = native.steps
        assert_greedy_matches_reference(llm, ref, PROMPTS[:3], 16)
        assert native.steps > steps  # the decode steps took the compiled path
        tokens, values = logprobs(llm, PROMPTS)
    finally:
        llm.close()
    one, _ = _llm(tmp_path / "tp1")
    one.engine.model.native_decode = None  # one process, the layers in Python
    want_tokens, want_values = logprobs(one, PROMPTS)
    assert tokens == want_tokens
    assert max(abs(a - b) for va, vb in zip(values, want_values) for a, b in zip(va, vb)) < 1e-4
    assert len({t for row in tokens for t in row}) > 4


def test_tp2_lora_rows_match_peft(tmp_path):
    """Each rank adds its shard's adapter delta: whole for qkv and gate_up (its output rows), a
    partial sum for o and down (its input columns of A), which the step's all-reduce sums."""
    llm, path = _llm(tmp_path, "llama", Q.Q8_0, tensor_parallel_size=2, enable_lora=True, max_loras=2,
                     max_lora_rank=8)
    try:
        _, ref = reference(path)
        adapters = [LoRARequest(f"a{i}", i + 1, str(adapter_of(copy.deepcopy(ref), tmp_path / f"a{i}", i, r, 2 * r)))
                    for i, r in enumerate((8, 4))]
        native = llm.engine.model.native_decode
        assert native is not None and native.weights.tp_group is not None
        for lora in adapters:
            steps = native.steps
            tokens, _ = _generate(llm, lora)
            assert native.steps > steps
            assert tokens == peft_greedy_of(copy.deepcopy(ref), lora.lora_path, LORA_PROMPTS, NEW_TOKENS), lora.lora_name
    finally:
        llm.close()
