"""Paged decode attention through the compiled step's kernel (pdserve.kernels.native_paged) for
the decode rows the Python layers run (mixed steps): over a bf16 cache it reads the blocks as
they are (no gather and widen), over a float32 cache it replaces numba's kernel. Both against a
float64 attention over the values the cache holds."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels import fp8_kv, native_gemv, native_paged, numba_ops

pytestmark = pytest.mark.skipif(native_gemv.library() is None, reason="no compiled kernels on this machine")

HEADS, KV_HEADS, BLOCK = 9, 3, 16


def _paged(dtype: torch.dtype, head_dim: int, lens: list[int], seed: int):
    """A block-major pool of 3 layers (layer 1's K and V planes), each sequence's blocks shuffled,
    and queries as strided views of a qkv projection's rows."""
    g = torch.Generator().manual_seed(seed)
    per = [-(-n // BLOCK) for n in lens]
    pool = torch.randn(sum(per) + 3, 3, 2, BLOCK, KV_HEADS, head_dim, generator=g).to(dtype)
    order = torch.randperm(pool.shape[0], generator=g).tolist()
    tables = torch.full((len(lens), max(per) + 1), -1, dtype=torch.int32)  # padding is never read
    for b, n in enumerate(per):
        tables[b, :n] = torch.tensor([order.pop() for _ in range(n)])
    qkv = torch.randn(len(lens), (HEADS + 2 * KV_HEADS) * head_dim, generator=g)
    q = qkv[:, :HEADS * head_dim].view(len(lens), HEADS, head_dim)
    return q, pool[:, 1, 0], pool[:, 1, 1], tables, torch.tensor(lens, dtype=torch.int32)


def _reference(q, k_cache, v_cache, tables, lens, scale, window=0, sinks=None):
    """float64 softmax(q k^T scale) v over each sequence's (last `window`) keys, sinks in the sum."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(max(0, n - window) if window else 0, n)
        blocks, slots = tables[b, pos // BLOCK].long(), pos % BLOCK
        k, v = k_cache[blocks, slots].double(), v_cache[blocks, slots].double()
        for h in range(q.shape[1]):
            scores = k[:, h // group] @ q[b, h].double() * scale
            if sinks is not None:
                scores = torch.cat([scores, sinks[h:h + 1].double()])
            out[b, h] = scores.softmax(0)[:len(pos)] @ v[:, h // group]
    return out


CASES = [(64, 0, False), (64, 40, False), (64, 0, True), (128, 0, False), (96, 0, False)]


@pytest.mark.parametrize("head_dim,window,with_sinks", CASES)
def test_a_bf16_cache_is_read_as_it_is(head_dim, window, with_sinks, monkeypatch):
    q, k_cache, v_cache, tables, lens = _paged(torch.bfloat16, head_dim, [1, 17, 300, 64, 129], seed=head_dim)
    sinks = torch.randn(HEADS) if with_sinks else None
    ops = fp8_kv.NarrowKVOps(numba_ops, k_cache.unsqueeze(1).unsqueeze(1), [(1.0, 1.0)], k_views=[k_cache])

    def gathered(*args, **kwargs):
        raise AssertionError("the bf16 cache was gathered and widened")
    monkeypatch.setattr(fp8_kv, "_compact_blocks", gathered)
    extra = {"window": window} if window else {}
    if sinks is not None:
        extra["sinks"] = sinks
    out = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, **extra)
    ref = _reference(q, k_cache, v_cache, tables, lens, 0.125, window, sinks)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim,window,with_sinks", CASES)
def test_a_float32_cache_takes_the_compiled_steps_kernel(head_dim, window, with_sinks):
    q, k_cache, v_cache, tables, lens = _paged(torch.float32, head_dim, [5, 200, 33, 1], seed=7 + head_dim)
    sinks = torch.randn(HEADS) if with_sinks else None
    out = numba_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, window, sinks)
    compiled = native_paged.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, window, sinks)
    assert torch.equal(out, compiled)  # the compiled kernel's values, not numba's
    ref = _reference(q, k_cache, v_cache, tables, lens, 0.125, window, sinks)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    numba = numba_ops.numba_decode_attention(q.contiguous(), k_cache, v_cache, tables, lens, 0.125, window, sinks)
    torch.testing.assert_close(out, numba, atol=1e-5, rtol=1e-5)


def test_rows_it_does_not_take_fall_back():
    q, k_cache, v_cache, tables, lens = _paged(torch.float32, 64, [9, 20], seed=3)
    assert native_paged.paged_decode_attention(q.to(torch.bfloat16), k_cache, v_cache, tables, lens, 0.125) is None
    fp16 = k_cache.half()
    assert native_paged.paged_decode_attention(q, fp16, fp16, tables, lens, 0.125) is None


@pytest.mark.parametrize("dtype,window,with_sinks", [(torch.bfloat16, 0, False), (torch.bfloat16, 40, True),
                                                     (torch.float32, 0, False)])
def test_many_sequences_take_one_item_each_with_the_same_values(dtype, window, with_sinks):
    """From 4 sequences a thread, each work item is a sequence with all its KV heads in turn (the
    heads' rows share cache lines): against the float64 attention, and bit for bit the values of
    the same rows in batches too small for that (one item per sequence and KV head)."""
    count = 4 * torch.get_num_threads() + 4
    lens = [1 + (37 * i) % 300 for i in range(count)]
    q, k_cache, v_cache, tables, lens_t = _paged(dtype, 64, lens, seed=11)
    sinks = torch.randn(HEADS) if with_sinks else None
    out = native_paged.paged_decode_attention(q, k_cache, v_cache, tables, lens_t, 0.125, window, sinks)
    ref = _reference(q, k_cache, v_cache, tables, lens_t, 0.125, window, sinks)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    small = [native_paged.paged_decode_attention(q[i:i + 2], k_cache, v_cache, tables[i:i + 2], lens_t[i:i + 2], 0.125,
                                                 window, sinks) for i in range(0, count, 2)]
    assert torch.equal(out, torch.cat(small))
