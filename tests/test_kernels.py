"""Every kernel backend (torch, numba, triton) against a naive float64 reference written here.

The Triton backend runs under TRITON_INTERPRET=1 when there is no GPU (set in conftest.py), so
sizes stay small. Caches are strided per-layer views of a block-major tensor filled with random
garbage, block tables are shuffled, and q/k/v are slices of a packed qkv tensor: a kernel that
assumes contiguity, reads the wrong block or misaligns the causal mask gets garbage, not a
near-miss.
"""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from pdserve.kernels import get_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "numba", "triton"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
NUM_LAYERS, LAYER = 3, 1


# ----------------------------------------------------------------------------- helpers

def reference_attention(q, k, v, scale):
    """q [L, H, D] are the LAST L tokens of a context whose keys/values are k, v [C, KVH, D]."""
    q_len, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    # Query head h uses KV head h // group: the GQA mapping every backend must follow.
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("lhd,chd->hlc", q.double(), k) * scale
    q_pos = torch.arange(ctx - q_len, ctx, device=q.device)  # causal mask aligned to the END
    visible = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hlc,chd->lhd", scores.softmax(-1), v)


def make_cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen):
    """A block-major KV tensor full of garbage and the strided per-layer K and V views."""
    kv = 3 * torch.randn(num_blocks, NUM_LAYERS, 2, block_size, kv_heads, head_dim, generator=gen)
    kv = kv.to(DEVICE, dtype)
    return kv, kv[:, LAYER, 0], kv[:, LAYER, 1]


def fill_sequences(k_cache, v_cache, ctx_lens, gen):
    """Random K/V for each sequence written into shuffled blocks: (block_tables, ks, vs)."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    needed = [-(-c // block_size) for c in ctx_lens]
    assert sum(needed) <= num_blocks
    free = torch.randperm(num_blocks, generator=gen).tolist()
    # One spare column: padding entries must never be read.
    tables = torch.full((len(ctx_lens), max(needed) + 1), num_blocks - 1, dtype=torch.int32)
    ks, vs = [], []
    for i, ctx in enumerate(ctx_lens):
        blocks = torch.tensor([free.pop() for _ in range(needed[i])])
        tables[i, :needed[i]] = blocks
        pos = torch.arange(ctx)
        idx = (blocks[pos // block_size].to(DEVICE), (pos % block_size).to(DEVICE))
        k = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(DEVICE, k_cache.dtype)
        v = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(DEVICE, k_cache.dtype)
        k_cache[idx], v_cache[idx] = k, v
        ks.append(k)
        vs.append(v)
    return tables.to(DEVICE), ks, vs


def packed_qkv(tokens, heads, kv_heads, head_dim, dtype, gen):
    """q, k, v as strided slices of one [T, heads + 2 * kv_heads, D] projection output."""
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    return qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]


def assert_close(out, ref, dtype):
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


# ----------------------------------------------------------------------------- store_kv

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_store_kv_writes_named_slots_and_skips_minus_one(backend, dtype):
    gen = torch.Generator().manual_seed(0)
    block_size, kv_heads, head_dim, tokens = 4, 2, 16, 11
    kv, k_cache, v_cache = make_cache(6, block_size, kv_heads, head_dim, dtype, gen)
    _, key, value = packed_qkv(tokens, 4, kv_heads, head_dim, dtype, gen)
    slots = torch.randperm(6 * block_size, generator=gen)[:tokens]
    slots[[1, 5, 6]] = -1
    expected = kv.double().clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, LAYER, 0, slot % block_size] = key[t].double()
            expected[slot // block_size, LAYER, 1, slot % block_size] = value[t].double()

    get_ops(backend).store_kv(key, value, k_cache, v_cache, slots.to(DEVICE))
    # Whole tensor: other layers, the other half (K vs V) and skipped slots stay untouched.
    assert torch.equal(kv.double(), expected)


# ----------------------------------------------------------------------------- decode

DECODE_CASES = {
    # heads, kv_heads, head_dim, block_size, context lengths
    "gqa": (8, 2, 16, 4, [1, 7, 13, 16]),
    "mha": (4, 4, 32, 8, [9, 3]),
    "mqa-odd-dim": (6, 1, 24, 4, [5, 11]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_decode_attention(backend, case, dtype):
    heads, kv_heads, head_dim, block_size, ctx_lens = DECODE_CASES[case]
    gen = torch.Generator().manual_seed(1)
    _, k_cache, v_cache = make_cache(12, block_size, kv_heads, head_dim, dtype, gen)
    tables, ks, vs = fill_sequences(k_cache, v_cache, ctx_lens, gen)
    q, _, _ = packed_qkv(len(ctx_lens), heads, kv_heads, head_dim, dtype, gen)
    scale = head_dim ** -0.5
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)

    out = get_ops(backend).paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale)

    assert out.shape == q.shape
    ref = torch.stack([reference_attention(q[i:i + 1], ks[i], vs[i], scale)[0]
                       for i in range(len(ctx_lens))])
    assert_close(out, ref, dtype)


# ----------------------------------------------------------------------------- prefill

PREFILL_CASES = {
    # heads, kv_heads, head_dim, block_size, (context length, new tokens) per sequence
    "mixed-prefix": (8, 2, 16, 4, [(5, 5), (13, 4), (9, 1), (7, 7)]),
    "no-prefix": (4, 2, 32, 8, [(3, 3), (10, 10)]),
    "mqa-odd-dim": (3, 1, 24, 4, [(17, 6), (4, 4)]),
}


def prefill_inputs(case: tuple, num_blocks: int, dtype, gen: torch.Generator) -> dict:
    """A prefill case (heads, kv_heads, head_dim, block_size, [(context, new tokens)...]): its
    sequences in a shuffled paged cache, and their new tokens' q/k/v packed, the new K/V being
    the tail of what is cached. cu: the packed rows' offsets per sequence."""
    heads, kv_heads, head_dim, block_size, seqs = case
    ctx_lens, q_lens = [c for c, _ in seqs], [n for _, n in seqs]
    _, k_cache, v_cache = make_cache(num_blocks, block_size, kv_heads, head_dim, dtype, gen)
    tables, ks, vs = fill_sequences(k_cache, v_cache, ctx_lens, gen)
    q, k_new, v_new = packed_qkv(sum(q_lens), heads, kv_heads, head_dim, dtype, gen)
    cu = [0]
    for i, n in enumerate(q_lens):
        k_new[cu[-1]:cu[-1] + n], v_new[cu[-1]:cu[-1] + n] = ks[i][-n:], vs[i][-n:]
        cu.append(cu[-1] + n)
    return dict(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache, tables=tables,
                ks=ks, vs=vs, cu=cu, ctx_lens=ctx_lens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_attention(backend, case, dtype):
    x = prefill_inputs(PREFILL_CASES[case], 16, dtype, torch.Generator().manual_seed(2))
    q, cu, ks, vs = x["q"], x["cu"], x["ks"], x["vs"]
    scale = 0.7 / math.sqrt(PREFILL_CASES[case][2])

    out = get_ops(backend).prefill_attention(
        q, x["k_new"], x["v_new"], x["k_cache"], x["v_cache"], torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        torch.tensor(x["ctx_lens"], dtype=torch.int32, device=DEVICE), x["tables"], scale)

    assert out.shape == q.shape
    ref = torch.cat([reference_attention(q[cu[i]:cu[i + 1]], ks[i], vs[i], scale) for i in range(len(ks))])
    assert_close(out, ref, dtype)


COMPILED_PREFILL_CASES = {
    # head_dim a multiple of 64: native_prefill.c takes the fresh prompts (context == new tokens)
    # and the chunks after a cached prefix (prefixes across query blocks and cache blocks)
    "gqa-64": (9, 3, 64, 16, [(40, 40), (50, 10), (1, 1), (100, 100), (17, 17), (130, 45)]),
    "mha-128": (4, 4, 128, 16, [(70, 70), (20, 5), (33, 33), (81, 1)]),
}


@pytest.mark.parametrize("case", COMPILED_PREFILL_CASES)
def test_compiled_prefill_takes_fresh_prompts_and_cached_prefixes(case, monkeypatch):
    """The numba backend's prefill over a float32 cache runs every prompt in compiled calls
    (native_prefill.c): those without a cached prefix in one, those after one in another, none
    through torch's path; all against float64."""
    from pdserve.kernels import native_gemv, torch_ops
    if DEVICE != "cpu" or native_gemv.library() is None:
        pytest.skip("no compiled library here (no C compiler, neither AVX-512 nor AVX2, or a GPU run)")
    skipped: list[set[int]] = []
    attend_each = torch_ops.attend_each

    def spy(*args, skip=frozenset(), **kwargs):
        skipped.append(set(skip))
        attend_each(*args, skip=skip, **kwargs)
    monkeypatch.setattr(torch_ops, "attend_each", spy)
    spec = COMPILED_PREFILL_CASES[case]
    x = prefill_inputs(spec, 40, torch.float32, torch.Generator().manual_seed(3))
    q, cu, ks, vs = x["q"], x["cu"], x["ks"], x["vs"]
    scale = 0.7 / math.sqrt(spec[2])
    out = get_ops("numba").prefill_attention(
        q, x["k_new"], x["v_new"], x["k_cache"], x["v_cache"], torch.tensor(cu, dtype=torch.int32),
        torch.tensor(x["ctx_lens"], dtype=torch.int32), x["tables"], scale)
    ref = torch.cat([reference_attention(q[cu[i]:cu[i + 1]], ks[i], vs[i], scale) for i in range(len(ks))])
    assert_close(out, ref, torch.float32)
    assert skipped == []  # the compiled calls took every sequence


# ----------------------------------------------------------------------------- all together

@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_then_decode_through_store_kv(backend):
    """The cache is written only by store_kv: chunked prefill of 11 tokens, then 3 decode steps."""
    ops = get_ops(backend)
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block_size, total = 4, 2, 16, 4, 14
    _, k_cache, v_cache = make_cache(8, block_size, kv_heads, head_dim, torch.float32, gen)
    q, k, v = packed_qkv(total, heads, kv_heads, head_dim, torch.float32, gen)
    table = torch.tensor([[6, 2, 7, 0, 5]], dtype=torch.int32, device=DEVICE)
    slots = (table[0].long()[torch.arange(total) // block_size] * block_size
             + torch.arange(total, device=DEVICE) % block_size)
    scale = head_dim ** -0.5
    ref = reference_attention(q, k, v, scale)

    def as_i32(*xs):
        return torch.tensor(xs, dtype=torch.int32, device=DEVICE)

    for start, end in [(0, 6), (6, 11)]:
        ops.store_kv(k[start:end], v[start:end], k_cache, v_cache, slots[start:end])
        out = ops.prefill_attention(q[start:end], k[start:end], v[start:end], k_cache, v_cache,
                                    as_i32(0, end - start), as_i32(end), table, scale)
        assert_close(out, ref[start:end], torch.float32)
    for t in range(11, total):
        ops.store_kv(k[t:t + 1], v[t:t + 1], k_cache, v_cache, slots[t:t + 1])
        out = ops.paged_decode_attention(q[t:t + 1], k_cache, v_cache, table, as_i32(t + 1),
                                         scale)
        assert_close(out, ref[t:t + 1], torch.float32)


def test_triton_rejects_oversized_head_dim():
    ops = get_ops("triton")
    q = torch.zeros(1, 2, 512, device=DEVICE)
    cache = torch.zeros(1, 4, 2, 512, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        ops.paged_decode_attention(q, cache, cache, table, lens, 1.0)


def test_compiled_kernels_run_on_openmp_where_it_loads():
    """pdserve's numba kernels launch on the OpenMP layer (kernels/numba_threads.py: ~50x less
    launch cost than the workqueue layer) when an OpenMP runtime is installed, and fall back to
    the workqueue layer when not; run in a fresh process, where the layer is chosen."""
    pytest.importorskip("numba")
    code = ("import numba\n"
            "try:\n    import numba.np.ufunc.omppool\n    want = 'omp'\n"
            "except ImportError:\n    want = 'workqueue'\n"
            "from pdserve.kernels import numba_moe, numba_ops\n"
            "numba_ops.warm_up()\n"
            "print(want, numba.threading_layer())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         check=True).stdout.split()
    assert out[0] == out[1], out
