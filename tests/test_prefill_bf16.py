"""The bf16 prefill attention, on AMX's tiles (native_prefill_amx.c) and in AVX-512 BF16's vdpbf16ps
(native_prefill_dpbf16.c), taken where the step's products are bf16 tiles: against a float64
attention of the same bf16-rounded queries (the only other rounding is the probabilities', 2^-9 of
each), beside prompts with a cached prefix that the float32 kernel takes in the same call; float32
products keep the float32 kernel, bit for bit; and an engine's greedy tokens with it against the
same engine with the float32 kernel. Each test runs once for each kernel this CPU has (AMX on the
Xeons, vdpbf16ps on AMX's Xeons and on Zen 4 and 5) and skips where it has neither."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf import write_gguf

from pdserve import LLM, SamplingParams
from pdserve.kernels import dequant_tiles, native_gemv, native_prefill, torch_ops
from pdserve.testing.model_factory import assert_agrees_until_a_near_tie


@pytest.fixture(params=["amx", "dpbf16"])
def backend(request, monkeypatch) -> str:
    """Each bf16 kernel in turn, where this CPU has it (skipped where not), as the one picked."""
    if native_gemv.library() is None or request.param not in native_prefill.bf16_backends():
        pytest.skip(f"no {request.param} kernel (or no compiled kernels) on this CPU")
    monkeypatch.setattr(native_prefill, "bf16_backends", lambda: [request.param])
    return request.param


@pytest.fixture
def bf16_tiles(backend):
    """bf16 tile products for the test (conftest.py puts this process's dtype back after it)."""
    dequant_tiles.set_tile_dtype(torch.bfloat16)


def _step(heads: int, kv_heads: int, dim: int, fresh: list[int], cached: tuple[int, int] | None, seed: int):
    """One prefill step's q, k, v (keys and values bf16-exact: a bf16 cache's rows) and the
    arguments of prefill_attention: `fresh` prompts' lengths, then one prompt of `cached` =
    (new tokens, cached prefix) whose prefix is in a paged cache."""
    gen = torch.Generator().manual_seed(seed)
    new = fresh + ([cached[0]] if cached else [])
    contexts = fresh + ([sum(cached)] if cached else [])
    tokens, block = sum(new), 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    k.copy_(k.bfloat16().float())
    v.copy_(v.bfloat16().float())
    blocks = (max(contexts) + block - 1) // block
    k_cache = torch.randn(len(new) * blocks, block, kv_heads, dim, generator=gen).bfloat16().float()
    v_cache = torch.randn(len(new) * blocks, block, kv_heads, dim, generator=gen).bfloat16().float()
    tables = torch.arange(len(new) * blocks, dtype=torch.int32).view(len(new), blocks)
    cu = torch.tensor([0] + [sum(new[:i + 1]) for i in range(len(new))], dtype=torch.int32)
    return q, k, v, k_cache, v_cache, cu, torch.tensor(contexts, dtype=torch.int32), tables


def _float64_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("heads, kv_heads, dim, fresh", [(9, 3, 64, [1, 17, 40, 160, 33]), (4, 2, 128, [5, 64, 65, 129]),
                                                         (8, 8, 64, [31, 32, 97])])
def test_bf16_prefill_attention_is_attention_of_bf16_queries(bf16_tiles, heads, kv_heads, dim, fresh):
    q, k, v, k_cache, v_cache, cu, contexts, tables = _step(heads, kv_heads, dim, fresh, (21, 40), len(fresh))
    scale = dim ** -0.5
    calls = native_prefill.bf16_calls
    out = native_prefill.prefill_attention(q, k, v, k_cache, v_cache, cu, contexts, tables, scale)
    assert native_prefill.bf16_calls == calls + 1
    starts = cu.tolist()
    for i, length in enumerate(fresh):
        rows = slice(starts[i], starts[i] + length)
        want = _float64_attention(q[rows].bfloat16().float(), k[rows], v[rows], scale)
        # each weight rounded to bf16 after its division: at most 2^-9 of it off
        bound = 2 ** -9 * v[rows].abs().max().item() + 1e-5
        assert (out[rows].double() - want).abs().max().item() <= bound
    # the cached prefix's prompt (a float32 cache): the float32 kernel's, as under float32 products
    last, prefix = slice(starts[-2], starts[-1]), contexts[-1].item() - (starts[-1] - starts[-2])
    keys = torch.cat([torch_ops.gather_kv(k_cache, tables[-1], prefix), k[last]])
    values = torch.cat([torch_ops.gather_kv(v_cache, tables[-1], prefix), v[last]])
    want = _float64_after_prefix(q[last], keys, values, scale)
    assert (out[last].double() - want).abs().max().item() < 1e-5


def test_float32_products_keep_the_float32_kernel(backend):
    assert dequant_tiles.tile_dtype() == torch.float32
    q, k, v, k_cache, v_cache, cu, contexts, tables = _step(9, 3, 64, [40, 160], None, 3)
    calls = native_prefill.bf16_calls
    out = native_prefill.prefill_attention(q, k, v, k_cache, v_cache, cu, contexts, tables, 0.125)
    assert native_prefill.bf16_calls == calls
    want = torch.empty_like(q)
    starts, lens = torch.tensor([0, 40], dtype=torch.int32), torch.tensor([40, 160], dtype=torch.int32)
    assert native_gemv.library().pd_prefill_attention(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), starts.data_ptr(),
        lens.data_ptr(), 2, 9, 3, 64, 0.125, want.data_ptr(), 1) == 0
    assert torch.equal(out, want)


def test_engine_with_bf16_prefill_attention_agrees_with_float32_attention(tmp_path, monkeypatch, bf16_tiles):
    """A bf16-products engine's greedy tokens and prompt logits with the bf16 prefill attention
    against the same engine with the float32 kernel: equal until a near tie, logits close. Steps
    of 48 tokens split the prompts, so later chunks read their prefix from the bf16 cache."""
    path = write_gguf(tmp_path / "llama.Q8_0.gguf", "llama", Q.Q8_0, dims=dict(hidden_size=256))  # head_dim 64
    llm = LLM(str(path), num_kv_blocks=64, cpu_gemm_dtype="bfloat16", enable_prefix_caching=False,
              max_num_batched_tokens=48)
    prompts = [[(7 * i + 3 * n) % 200 + 3 for i in range(n)] for n in (24, 57, 90)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    runs, logits = {}, {}
    paged, with_prefix = native_prefill.prefill_attention_bf16_cache, []

    def counted(q, k, v, k_cache, v_cache, cu, contexts, *rest):
        with_prefix.append(bool((contexts != cu.diff()).any()))
        return paged(q, k, v, k_cache, v_cache, cu, contexts, *rest)
    for name in ("float32", "bf16"):
        with pytest.MonkeyPatch.context() as patch:  # this run's kernels only (the backend's stays)
            if name == "bf16":
                patch.setattr(native_prefill, "prefill_attention_bf16_cache", counted)
            if name == "float32":
                patch.setattr(native_prefill, "_kernels", lambda: [native_gemv.library().pd_prefill_attention])
                patch.setattr(native_prefill, "prefill_attention_bf16_cache", lambda *a: None)
            calls = native_prefill.bf16_calls
            runs[name] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            logits[name] = llm.engine.prompt_logits(prompts[-1])
            assert (native_prefill.bf16_calls > calls) == (name == "bf16")
    assert any(with_prefix)  # chunks after the first took the paged bf16 path
    diff = (logits["bf16"] - logits["float32"]).abs().max().item()
    assert 0 < diff < 0.05 * logits["float32"].abs().max().item()
    assert_agrees_until_a_near_tie(runs["float32"], runs["bf16"], 4 * diff)


def _float64_after_prefix(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q's rows are the last q.shape[0] positions of keys: each sees the prefix and itself and before."""
    group, prefix = q.shape[1] // keys.shape[1], keys.shape[0] - q.shape[0]
    k, v = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    sees = torch.arange(keys.shape[0])[None, :] <= prefix + torch.arange(q.shape[0])[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~sees, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 2, 128)])
def test_bf16_kernel_reads_a_cached_prefix_from_the_bf16_blocks(bf16_tiles, monkeypatch, heads, kv_heads, dim):
    """Over a bf16 cache (NarrowKVOps) every prompt of the step, fresh or after a cached prefix,
    goes through one call of the bf16 kernel that reads the prefix's blocks as they are: the blocks never
    gathered and widened (_compact_blocks), torch's attention never called; each row against a
    float64 attention of its bf16 query over the cached and the new keys."""
    from pdserve.kernels import fp8_kv, numba_ops
    gen = torch.Generator().manual_seed(dim)
    block, blocks_each = 16, 12
    seqs = [(40, 0), (21, 40), (1, 33), (70, 100), (17, 16)]  # (new tokens, cached prefix)
    cache = torch.zeros(len(seqs) * blocks_each, 2, 2, block, kv_heads, dim, dtype=torch.bfloat16)
    cache.normal_(generator=gen)
    kc, vc = cache[:, 1, 0], cache[:, 1, 1]
    ops = fp8_kv.NarrowKVOps(numba_ops, cache, [(1.0, 1.0)] * 2)
    tables = torch.randperm(len(seqs) * blocks_each, generator=gen).view(len(seqs), blocks_each).to(torch.int32)
    tokens = sum(n for n, _ in seqs)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    slots = torch.cat([torch.stack([tables[i, (p + j) // block] * block + (p + j) % block for j in range(n)])
                       for i, (n, p) in enumerate(seqs)]).long()
    cu = torch.tensor([0] + [sum(n for n, _ in seqs[:i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    contexts = torch.tensor([n + p for n, p in seqs], dtype=torch.int32)
    monkeypatch.setattr(fp8_kv, "_compact_blocks", lambda *a: pytest.fail("blocks gathered and widened"))
    monkeypatch.setattr(torch_ops, "attend_each", lambda *a, **k: pytest.fail("torch's attention ran"))
    calls = native_prefill.bf16_calls
    ops.store_kv(k, v, kc, vc, slots)
    out = ops.prefill_attention(q, k, v, kc, vc, cu, contexts, tables, dim ** -0.5)
    assert native_prefill.bf16_calls == calls + 1
    for i, (n, p) in enumerate(seqs):
        positions = torch.arange(n + p)
        where = tables[i, positions // block].long(), positions % block
        keys, values = kc[where].float(), vc[where].float()  # the prefix's and the new rows, as cached
        rows = slice(cu[i].item(), cu[i + 1].item())
        want = _float64_after_prefix(q[rows].bfloat16().float(), keys, values, dim ** -0.5)
        assert (out[rows].double() - want).abs().max().item() <= 2 ** -9 * values.abs().max().item() + 1e-5
