"""LoRA adapters in the compiled decode step (pdserve.kernels.native_decode): each decode row adds
its own adapter's delta (x A^T) B^T to the qkv, o, gate_up and down products, so one step may
hold rows of several adapters and of the base model. A quantized Llama GGUF with two PEFT
adapters (random A and B on every projection): greedy tokens equal PEFT's PeftModel.generate on
the dequantized model, the steps take the compiled path, and a step mixing both adapters and the
base model gives the tokens, and logprobs within 1e-4, of the same engine running its layers in
Python. The test fails when native_decode.c drops the delta (checked by making lora_add return
at once)."""
from __future__ import annotations

import copy

import gguf
import pytest
from lora_util import peft_greedy_of
from test_gguf import reference
from test_native_decode import _llm, logprobs, pytestmark  # noqa: F401

from pdserve import SamplingParams
from pdserve.lora.request import LoRARequest
from pdserve.testing.lora_adapters import adapter_of

Q = gguf.GGMLQuantizationType
PROMPTS = [list(range(3, 3 + n)) for n in (6, 17, 30)]
NEW_TOKENS = 10


@pytest.fixture(autouse=True)
def _private_cache(private_cache):
    """conftest's: a private PDSERVE_CACHE_DIR sharing the compiled kernels"""


def _generate(llm, loras, with_logprobs: bool = False):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1 if with_logprobs else None)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, lora_request=loras)
    tokens = [o.outputs[0].token_ids for o in outs]
    return tokens, [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs] if with_logprobs else None


def test_lora_rows_take_the_compiled_step_and_match_peft(tmp_path):
    llm, path = _llm(tmp_path, "llama", Q.Q8_0, enable_lora=True, max_loras=2, max_lora_rank=8)
    _, ref = reference(path)
    adapters = [LoRARequest(f"a{i}", i + 1, str(adapter_of(copy.deepcopy(ref), tmp_path / f"a{i}", i, r, 2 * r)))
                for i, r in enumerate((8, 4))]
    native = llm.engine.model.native_decode
    assert native is not None, "an engine with adapters has no compiled decode step"
    for lora in adapters:
        steps = native.steps
        tokens, _ = _generate(llm, lora)
        assert native.steps > steps
        assert tokens == peft_greedy_of(copy.deepcopy(ref), lora.lora_path, PROMPTS, NEW_TOKENS), lora.lora_name
    # One step's rows under a0, a1 and the base model; then the same with the layers in Python.
    mixed = [adapters[0], None, adapters[1]]
    steps = native.steps
    tokens, values = _generate(llm, mixed, with_logprobs=True)
    assert native.steps > steps
    llm.engine.model.native_decode = None
    try:
        want_tokens, want_values = _generate(llm, mixed, with_logprobs=True)
    finally:
        llm.engine.model.native_decode = native
    assert tokens == want_tokens
    assert max(abs(a - b) for va, vb in zip(values, want_values) for a, b in zip(va, vb)) < 1e-4
    assert len({tuple(t) for t in tokens}) == 3
