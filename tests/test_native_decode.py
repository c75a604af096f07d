"""The compiled decode step (pdserve.kernels.native_decode): a decode step's layers in one C call.

A Llama GGUF kept quantized takes it for its decode steps; its greedy tokens equal transformers'
on the dequantized file, and its logprobs match the same engine running the layers in Python
(the reference the C code transcribes), with and without sliding windows, at several requests a
step. Steps it does not take (prefill, more than 64 rows) run in Python; it switches off with
the native kernels, and for layers it does not take (a bias on o_proj). Verify rows and the Qwen
layers: test_native_decode_rows.py."""
from __future__ import annotations

import gguf
import pytest
import torch
from gguf_kquants import quantize
from test_gguf import reference, write_gguf

from pdserve import LLM, SamplingParams
from pdserve.kernels import native_gemv
from pdserve.testing.model_factory import assert_greedy_matches_reference

Q = gguf.GGMLQuantizationType
SIZES = dict(hidden_size=256, intermediate_size=512)

pytestmark = pytest.mark.skipif(native_gemv.compiler() is None or native_gemv._why_not() is not None,
                                reason="no C compiler or neither AVX-512 nor AVX2: the compiled kernels are off")


@pytest.fixture(autouse=True)
def _private_cache(private_cache):
    """conftest's: a private PDSERVE_CACHE_DIR sharing the compiled kernels"""


def _llm(tmp_path, arch: str = "llama", qtype=Q.Q4_1, **engine) -> LLM:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = write_gguf(tmp_path / f"m.{arch}.gguf", arch, qtype, dims=SIZES, quantize=quantize)
    return LLM(str(path), num_kv_blocks=128, enable_prefix_caching=False, **engine), path


def logprobs(llm: LLM, prompts: list[list[int]], new_tokens: int = 12):
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    values = [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs]
    return tokens, values


PROMPTS = [list(range(3, 3 + n)) for n in (5, 19, 40, 33)]


def compare_with_python_layers(llm: LLM, prompts: list[list[int]] = PROMPTS) -> None:
    """Same engine, the layers in Python: the same greedy tokens, logprobs within 1e-4."""
    model = llm.engine.model
    native = model.native_decode
    before = native.steps
    tokens, values = logprobs(llm, prompts)
    assert native.steps > before  # the decode steps took the compiled path
    model.native_decode = None
    try:
        want_tokens, want_values = logprobs(llm, prompts)
    finally:
        model.native_decode = native
    assert tokens == want_tokens
    assert max(abs(a - b) for va, vb in zip(values, want_values) for a, b in zip(va, vb)) < 1e-4
    assert len({t for row in tokens for t in row}) > 4  # varied output: the comparison means something


def check_tp2_compiled_step(path, reference, **engine) -> None:
    """The checkpoint at path at TP 2 (float32): every rank takes the compiled step over its
    shard, greedy tokens equal the reference's, and logprobs are within 1e-4 of one process
    running the layers in Python."""
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False, tensor_parallel_size=2,
              **engine)
    try:
        native = llm.engine.model.native_decode
        assert native is not None and native.weights.tp_group is not None
        steps = native.steps
        assert_greedy_matches_reference(llm, reference, PROMPTS[:3], 12)
        assert native.steps > steps
        tokens, values = logprobs(llm, PROMPTS)
    finally:
        llm.close()
    one = LLM(str(path), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    one.engine.model.native_decode = None  # one process, the layers in Python
    want_tokens, want_values = logprobs(one, PROMPTS)
    assert tokens == want_tokens
    assert max(abs(a - b) for va, vb in zip(values, want_values) for a, b in zip(va, vb)) < 1e-4


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_compiled_decode_matches_transformers_and_the_python_layers(tmp_path, qtype):
    llm, path = _llm(tmp_path, qtype=qtype)
    assert llm.engine.model.native_decode is not None
    _, ref = reference(path)
    steps = llm.engine.model.native_decode.steps
    assert_greedy_matches_reference(llm, ref, PROMPTS[:3], 16)
    assert llm.engine.model.native_decode.steps > steps
    compare_with_python_layers(llm)


def test_compiled_decode_with_sliding_windows(tmp_path):
    """Windows of 8 and 16 tokens on alternate layers (shorter than every prompt): the C kernel
    sees only each window, as the Python layers' attention does."""
    from pdserve.kernels.native_decode import plan_for

    llm, _ = _llm(tmp_path)
    model, runner = llm.engine.model, llm.engine.runner
    for i, layer in enumerate(model.layers):
        layer.self_attn.window = 8 if i % 2 == 0 else 16
    model.native_decode = plan_for(model, runner.layer_caches, runner.device)
    compare_with_python_layers(llm)


def test_steps_it_does_not_take_and_models_it_does_not_fit(tmp_path, monkeypatch):
    llm, _ = _llm(tmp_path)
    native = llm.engine.model.native_decode
    before = native.steps
    # 70 requests decode in steps of more rows than the compiled step takes (here 64): those run in Python.
    monkeypatch.setattr("pdserve.kernels.native_decode.MAX_STEP_TOKENS", 64)
    logprobs(llm, [list(range(3, 9))] * 70, new_tokens=2)
    assert native.steps == before
    llm.engine.model.layers[0].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(SIZES["hidden_size"]))
    assert isinstance(llm.engine.model.native_decode_weights(), str)  # a bias on o_proj: refused
    monkeypatch.setenv("PDSERVE_NATIVE_KERNELS", "0")
    native_gemv.library.cache_clear()
    (tmp_path / "off").mkdir()
    try:
        assert _llm(tmp_path / "off")[0].engine.model.native_decode is None
    finally:
        native_gemv.library.cache_clear()
