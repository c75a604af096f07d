"""--kv-cache-dtype bfloat16 on CPU: the paged cache holds bf16 (half float32's bytes) under a
float32 model.

Offline, on a small random Llama: the compiled decode step reads and writes the bf16 cache
(pdserve/kernels/native_decode.c) and gives the tokens and logprobs of the Python layers over the
same cache (pdserve.kernels.fp8_kv.NarrowKVOps, the compiled library off); the cache's elements
are the float32 engine's K/V rounded to bf16; prompt logprobs stay within bf16's rounding of the
float32 cache's; the block-key salt differs from float32's, and the router's follows the flag."""
from __future__ import annotations

from argparse import Namespace

import pytest
import torch
from transformers import AutoConfig

from pdserve import LLM, SamplingParams
from pdserve.kernels import native_gemv
from pdserve.models.gguf import checkpoint_name
from pdserve.router.main import _kv_dtype_name, layout_salt
from pdserve.testing.model_factory import make_model

PROMPTS = ["the thin tin man sat on a hat and the hat", "a hat in the hat is a cat in the",
           "hello world, my name is", "one two three four five six seven eight nine ten"]
NEW_TOKENS = 12
# |prompt logprob - the float32 cache's|, nats: bf16 keeps 8 significant bits (relative error up
# to 1/512 per element) on this random model's sharp logits; measured max 0.025, mean 0.007.
MEAN_BOUND, MAX_BOUND = 0.02, 0.15

needs_native = pytest.mark.skipif(native_gemv._why_not() is not None or native_gemv.compiler() is None,
                                  reason="neither AVX-512 nor AVX2 or no C compiler: the compiled step does not run")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("bf16kv"), "llama")


def _generate(path, kv_cache_dtype: str, **params):
    llm = LLM(str(path), num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, **params)
    return llm, llm.generate(PROMPTS, sampling, use_tqdm=False)


@needs_native
def test_compiled_step_reads_the_bf16_cache_as_the_python_layers_do(llama, monkeypatch):
    compiled, compiled_out = _generate(llama, "bfloat16", logprobs=1)
    assert compiled.engine.kv_cache.dtype == torch.bfloat16
    assert compiled.engine.runner.model.native_decode.steps > 0  # the compiled step ran on it
    monkeypatch.setenv("PDSERVE_NATIVE_KERNELS", "0")
    native_gemv.library.cache_clear()
    try:
        python, python_out = _generate(llama, "bfloat16", logprobs=1)
        assert python.engine.runner.model.native_decode is None
    finally:
        monkeypatch.undo()
        native_gemv.library.cache_clear()
    for a, b in zip(compiled_out, python_out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)


def test_the_cache_holds_float32_kv_rounded_and_logprobs_stay_near(llama):
    full, full_out = _generate(llama, "auto", prompt_logprobs=0)
    half, half_out = _generate(llama, "bfloat16", prompt_logprobs=0)
    assert half.engine.kv_cache.dtype.itemsize == 2 and full.engine.kv_cache.dtype.itemsize == 4
    # the first prompt's blocks (the same block ids in both pools)
    one = SamplingParams(max_tokens=1)
    caches = []
    for path_dtype in ("auto", "bfloat16"):
        llm = LLM(str(llama), num_kv_blocks=64, kv_cache_dtype=path_dtype)
        llm.generate(PROMPTS[:1], one, use_tqdm=False)
        caches.append(llm.engine.kv_cache)
    # layer 0's K/V come from the embeddings: the float32 engine's, rounded; later layers' inputs
    # went through attention over rounded K/V
    assert torch.equal(caches[1][:, 0], caches[0][:, 0].to(torch.bfloat16))
    assert torch.allclose(caches[1][:, 1].float(), caches[0][:, 1], rtol=0.02, atol=0.02)
    diffs = []
    for a, b in zip(full_out, half_out):
        diffs += [abs(la.logprob - lb.logprob) for la, lb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
    worst, mean = max(diffs), sum(diffs) / len(diffs)
    print(f"bf16 KV: |prompt logprob - float32 KV's| max {worst:.4f}, mean {mean:.4f} nats")
    assert 0 < mean < MEAN_BOUND and worst < MAX_BOUND  # mean 0: the cache was not rounded at all


def test_salts_differ_and_the_routers_follows_the_flag(llama):
    half, _ = _generate(llama, "bfloat16")
    full = LLM(str(llama), num_kv_blocks=64)
    assert half.engine.salt != full.engine.salt  # a bf16 block is never served to a float32 node
    config = AutoConfig.from_pretrained(str(llama))
    for kv, engine in (("bfloat16", half.engine), ("auto", full.engine)):
        name = _kv_dtype_name(Namespace(dtype="auto", kv_cache_dtype=kv))
        assert layout_salt(checkpoint_name(str(llama), llama), config, name, 16) == engine.salt


def test_a_prefix_read_back_from_the_bf16_cache_gives_what_computing_it_gave(llama):
    """The second run of a prompt takes its whole blocks from the bf16 cache (the prefill's
    attention then reads them back, widened); the first computed them and attended to its own
    K/V rounded the same way. Same tokens, same logprobs."""
    prompt = " ".join(PROMPTS)  # several whole 16-token blocks
    llm = LLM(str(llama), num_kv_blocks=64, kv_cache_dtype="bfloat16")
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    cold = llm.generate([prompt], sampling, use_tqdm=False)[0]
    warm = llm.generate([prompt], sampling, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens >= 16
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    for a, b in zip(warm.outputs[0].logprobs, cold.outputs[0].logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
