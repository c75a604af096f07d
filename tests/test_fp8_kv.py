"""--kv-cache-dtype fp8: the paged cache holds float8_e4m3fn (pdserve.kernels.fp8_kv).

Offline, on a small random Llama: prompt logprobs stay within MEAN_BOUND / MAX_BOUND of the
float32 cache's, the torch and numba kernels agree, checkpoint scales are read, the block-key
salts differ, and prefix-cache hits give the same tokens. The stores round-trip FP8 bytes and a
float32 node refuses an FP8 value. Served by `pdserve up` 1P1D over the store and over NIXL: the
official client gets the offline FP8 engine's greedy tokens, and the decode node loads a quarter
of a float32 cluster's bytes for the same prompt."""
from __future__ import annotations

import shutil
import time
from argparse import Namespace

import pytest
import torch
from openai import OpenAI
from safetensors.torch import save_file
from transformers import AutoConfig

from pdserve import LLM, SamplingParams
from pdserve.kernels.fp8_kv import checkpoint_kv_scales
from pdserve.kvstore.factory import make_store
from pdserve.kvstore.layout import KVLayout
from pdserve.kvstore.redis_store import HEADER, decode_into, encode_block
from pdserve.models.gguf import checkpoint_name
from pdserve.router.main import _kv_dtype_name, layout_salt
from pdserve.testing.model_factory import make_model
from pdserve.testing.redis_server import redis_server
from pdserve.testing.up_cluster import node_stats, running_clusters

# |logprob difference| over the prompt tokens, nats. e4m3 keeps 3 mantissa bits (relative error
# up to 1/16 per element), and this random model (weights std 0.2) has sharp logits; measured
# max 0.65, mean 0.11 (greedy tokens equal at 30 of 64 positions: once one differs, the rest follow it).
MEAN_BOUND, MAX_BOUND = 0.25, 1.5
PROMPTS = ["the thin tin man sat on a hat and the hat", "a hat in the hat is a cat in the",
           "hello world, my name is", "one two three four five six seven eight nine ten"]
CLUSTER_PROMPT = "the thin tin man sat on a hat and the hat, " * 3
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("fp8kv"), "llama")


def _run(path, kv_cache_dtype: str):
    llm = LLM(str(path), num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=0)
    return llm, llm.generate(PROMPTS, params, use_tqdm=False)


def test_prompt_logprobs_within_bound_of_float32_kv(llama):
    full, full_out = _run(llama, "auto")
    fp8, fp8_out = _run(llama, "fp8")
    assert fp8.engine.kv_cache.dtype.itemsize == 1 and full.engine.kv_cache.dtype.itemsize == 4
    diffs, agree, total = [], 0, 0
    for a, b in zip(full_out, fp8_out):
        diffs += [abs(la.logprob - lb.logprob) for la, lb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        agree += sum(x == y for x, y in zip(ta, tb))
        total += len(ta)
    worst, mean = max(diffs), sum(diffs) / len(diffs)
    print(f"fp8 KV: |prompt logprob - float32 KV's| max {worst:.4f}, mean {mean:.4f} nats over "
          f"{len(diffs)} tokens; greedy tokens equal at {agree}/{total} positions")
    assert 0 < mean < MEAN_BOUND and worst < MAX_BOUND  # mean 0: the cache was not quantized at all


def test_numba_and_torch_kernels_agree_and_checkpoint_scales_are_read(llama, tmp_path):
    """The wrapper dequantizes for whichever backend runs under it: both give the same tokens.
    Scales come from the checkpoint's k_scale / v_scale tensors where it has them."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = [[o.outputs[0].token_ids for o in LLM(str(llama), num_kv_blocks=64, kv_cache_dtype="fp8",
                                                   kernel_backend=kb).generate(PROMPTS, params, use_tqdm=False)]
            for kb in ("torch", "numba")]
    assert outs[0] == outs[1]
    assert checkpoint_kv_scales(llama, 2) == [(1.0, 1.0), (1.0, 1.0)]
    scaled = tmp_path / "scaled"
    shutil.copytree(llama, scaled)
    save_file({"model.layers.1.self_attn.k_scale": torch.tensor(0.3),
               "model.layers.0.self_attn.v_proj.output_scale": torch.tensor([3.0])}, scaled / "scales.safetensors")
    assert checkpoint_kv_scales(scaled, 2) == [(1.0, 3.0), (pytest.approx(0.3), 1.0)]
    caches = []
    for path in (llama, scaled):  # the loader skips the scales; the cache holds x / scale
        llm = LLM(str(path), num_kv_blocks=64, kv_cache_dtype="fp8")
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1), use_tqdm=False)  # the prompt's KV only
        caches.append(llm.engine.kv_cache.float())
    plain, scaled_cache = caches
    assert torch.equal(plain[:, 0, 0], scaled_cache[:, 0, 0])  # layer 0's K: scale 1.0 in both
    assert not torch.equal(plain[:, 1, 0], scaled_cache[:, 1, 0])  # layer 1's K: divided by 0.3
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(llama), kv_cache_dtype="int4")


def test_salts_differ_and_prefix_hits_read_what_was_stored(llama):
    fp8, first = _run(llama, "fp8")
    full = LLM(str(llama), num_kv_blocks=64)
    assert fp8.engine.salt != full.engine.salt  # an FP8 block is never served to a float32 node
    # The router's own salt (used until the nodes' pongs report theirs) follows --kv-cache-dtype.
    config = AutoConfig.from_pretrained(str(llama))
    for kv, engine in (("fp8", fp8.engine), ("auto", full.engine)):
        name = _kv_dtype_name(Namespace(dtype="auto", kv_cache_dtype=kv))
        assert layout_salt(checkpoint_name(str(llama), llama), config, name, 16) == engine.salt
    again = fp8.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
                         use_tqdm=False)
    assert fp8.engine.cached_prompt_tokens > 0  # the second pass read the FP8 prefix blocks
    for a, b in zip(first, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_store_value_of_an_fp8_node_is_refused_by_a_float32_node(llama):
    """The handover through the store: the value's header names its dtype, so a float32 decode
    node counts an FP8 block as missing (and recomputes) instead of reading its bytes."""
    fp8 = LLM(str(llama), num_kv_blocks=8, kv_cache_dtype="fp8").engine.kv_cache
    full = torch.zeros(fp8.shape, dtype=torch.float32)
    fp8[1] = torch.randn(fp8.shape[1:]).to(fp8.dtype)
    value = encode_block(fp8, 1, fp8.shape[3])
    assert len(value) - HEADER.size == fp8[1].numel()  # one byte an element
    assert not decode_into(value, full, 2, fp8.shape[3]) and not full.any()
    copy = torch.zeros_like(fp8)
    assert decode_into(value, copy, 2, fp8.shape[3])
    assert torch.equal(copy[2].view(torch.uint8), fp8[1].view(torch.uint8))


@pytest.mark.parametrize("scheme", ["", "direct+"])
def test_stores_round_trip_fp8_bytes(scheme):
    """LMCache (the default store, its metadata's kv_dtype float8) and the direct Redis store
    give back exactly the FP8 bytes put in."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float8_e4m3fn,
                      model_name="fp8-store")
    src = torch.randn(8, *layout.block_shape()).to(layout.dtype)
    keys = [bytes([i]) * 16 for i in range(8)]
    with redis_server() as (url, _):
        store = make_store(scheme + url, layout=layout, chunk_tokens=32)
        try:
            store.put(keys, src, list(range(8)), [16] * 8)
            dst = torch.zeros_like(src)
            assert store.get(keys, dst, list(range(8)), [16] * 8) == 8
        finally:
            store.close()
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


@pytest.fixture(scope="module")
def clusters():
    flags = ("--kv-transfer", "store", "--prefill-nodes", "1", "--decode-nodes", "1", "--num-kv-blocks", "128")
    nixl = ("--kv-transfer", "nixl", *flags[2:], "--kv-cache-dtype", "fp8")
    with running_clusters((*flags, "--kv-cache-dtype", "fp8"), flags, nixl) as started:
        yield [url for url, _ in started]


def _decode_loaded_bytes(url: str, path: str = "store") -> int:
    """The decode node's handover bytes over `path` (store or nixl), once its pongs report them."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        got = sum(n.get(f"transfer_bytes_{path}", 0) for n in node_stats(url).values() if n["role"] == "decode")
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"the decode node reported no bytes loaded over {path}")


def test_served_fp8_matches_offline_and_moves_a_quarter_of_the_bytes(clusters):
    fp8_url, full_url, nixl_url = clusters
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    want = LLM("builtin:tiny", num_kv_blocks=64, kv_cache_dtype="fp8").generate(
        [CLUSTER_PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    got = {}
    for url in clusters:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        choice = client.completions.create(model="builtin:tiny", prompt=CLUSTER_PROMPT, max_tokens=NEW_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True}
                                           ).choices[0]
        got[url] = choice.model_extra["token_ids"]
    assert got[fp8_url] == got[nixl_url] == list(want)
    fp8_bytes, full_bytes = _decode_loaded_bytes(fp8_url), _decode_loaded_bytes(full_url)
    nixl_bytes = _decode_loaded_bytes(nixl_url, "nixl")
    print(f"decode node loaded {fp8_bytes} bytes with fp8 KV ({nixl_bytes} over NIXL), {full_bytes} with float32 KV")
    assert fp8_bytes * 4 == full_bytes and nixl_bytes == fp8_bytes
