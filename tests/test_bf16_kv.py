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


def _rounded_path(key, value, k_cache, v_cache, slots):
    """The bf16 cache's store and new-row values as torch computes them (the path before the
    compiled store): rounded copies, index_put, rounded back."""
    from pdserve.kernels import torch_ops
    torch_ops.store_kv(key.to(torch.bfloat16), value.to(torch.bfloat16), k_cache, v_cache, slots)
    return key.to(torch.bfloat16).float(), value.to(torch.bfloat16).float()


@pytest.mark.skipif(native_gemv.library() is None, reason="no compiled kernels here")
@pytest.mark.parametrize("decode_rows", [0, 3])
def test_compiled_bf16_store_writes_and_hands_attention_what_torchs_rounding_did(decode_rows, monkeypatch):
    """NarrowKVOps over a bf16 cache stores a step's keys and values in one compiled pass
    (native_rows.c's pd_store_kv_bf16) and hands the prefill attention that follows the values
    it stored, not rounded again: the cache's words, and the prefill's output, equal torch's
    rounding path bit for bit (denormals and a skipped slot included; decode rows before the
    prefill's); the compiled pass is what ran (torch's rounding, fp8_kv.quantize, never did)."""
    from pdserve.kernels import fp8_kv, numba_ops
    torch.manual_seed(0)
    prompt, heads, kv_heads, dim, block = 40, 6, 2, 64, 16
    tokens = decode_rows + prompt
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    qkv[1, heads * dim + 5] = 1e-40  # a denormal key: kept, as torch keeps it
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    slots = torch.randperm(8 * block)[:tokens]
    slots[0] = -1
    caches = [torch.zeros(8, 2, 2, block, kv_heads, dim, dtype=torch.bfloat16) for _ in range(2)]
    ops = fp8_kv.NarrowKVOps(numba_ops, caches[0], [(1.0, 1.0)] * 2)
    seen_by_attention = []
    base_prefill = numba_ops.prefill_attention

    class Base:
        __name__ = numba_ops.__name__

        @staticmethod
        def prefill_attention(q, k_new, v_new, *rest, **extra):
            seen_by_attention.append((k_new, v_new))
            return base_prefill(q, k_new, v_new, *rest, **extra)
    ops.base = Base
    cu = torch.tensor([0, prompt], dtype=torch.int32)
    lens = torch.tensor([prompt], dtype=torch.int32)
    tables = torch.arange(8, dtype=torch.int32).view(1, 8)
    kc, vc = caches[0][:, 1, 0], caches[0][:, 1, 1]
    with monkeypatch.context() as m:
        m.setattr(fp8_kv, "quantize", lambda *a: pytest.fail("rounded by torch, not by the compiled store"))
        ops.store_kv(k, v, kc, vc, slots)
        got = ops.prefill_attention(q[decode_rows:], k[decode_rows:], v[decode_rows:], kc, vc, cu, lens, tables,
                                    0.125)
    k_want, v_want = _rounded_path(k, v, caches[1][:, 1, 0], caches[1][:, 1, 1], slots)
    want = base_prefill(q[decode_rows:], k_want[decode_rows:], v_want[decode_rows:], caches[1][:, 1, 0],
                        caches[1][:, 1, 1], cu, lens, tables, 0.125)
    assert torch.equal(caches[0].view(torch.int16), caches[1].view(torch.int16))
    assert torch.equal(got, want)
    (k_seen, v_seen), = seen_by_attention
    assert torch.equal(k_seen, k_want[decode_rows:]) and torch.equal(v_seen, v_want[decode_rows:])
