"""Sliding windows and attention sinks in every kernel backend (torch, numba, triton under
TRITON_INTERPRET=1 without a GPU) against a float64 reference written here: decode, prefill with
and without a cached prefix, GQA/MQA, windows shorter and longer than a block, windows that
cut a block in the middle, and a tile of the Triton kernel that starts past the window's
first keys."""
from __future__ import annotations

import pytest
import torch
from test_kernels import DEVICE, assert_close, fill_sequences, make_cache, packed_qkv

from pdserve.kernels import get_ops

BACKENDS = ["torch", "numba", "triton"]


def reference(q, k, v, scale, window=0, sinks=None):
    """q [L, H, D]: the LAST L tokens of a context with keys/values k, v [C, KVH, D]."""
    q_len, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("lhd,chd->hlc", q.double(), k) * scale
    q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
    k_pos = torch.arange(ctx, device=q.device)[None, :]
    visible = k_pos <= q_pos
    if window:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # one more logit per head, dropped after the softmax
        sink_col = sinks.double()[:, None, None].expand(heads, q_len, 1)
        probs = torch.cat([scores, sink_col], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hlc,chd->lhd", probs, v)


CASES = {
    # heads, kv_heads, head_dim, block_size, window, sinks
    "window-3-gqa": (8, 2, 16, 4, 3, False),
    "window-6-sinks": (4, 2, 16, 4, 6, True),
    "sinks-only-mqa": (6, 1, 24, 4, 0, True),
    "window-1": (4, 4, 16, 8, 1, False),
}


def _sinks(heads, gen, on):
    return (2 * torch.randn(heads, generator=gen)).to(DEVICE) if on else None


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_window_and_sinks(backend, case):
    heads, kv_heads, head_dim, block_size, window, with_sinks = CASES[case]
    gen = torch.Generator().manual_seed(5)
    ctx_lens = [1, 2, 7, 13, 16]
    _, k_cache, v_cache = make_cache(24, block_size, kv_heads, head_dim, torch.float32, gen)
    tables, ks, vs = fill_sequences(k_cache, v_cache, ctx_lens, gen)
    q, _, _ = packed_qkv(len(ctx_lens), heads, kv_heads, head_dim, torch.float32, gen)
    sinks = _sinks(heads, gen, with_sinks)
    scale = head_dim ** -0.5
    out = get_ops(backend).paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE), scale,
        window=window, sinks=sinks)
    ref = torch.stack([reference(q[i:i + 1], ks[i], vs[i], scale, window, sinks)[0]
                       for i in range(len(ctx_lens))])
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_window_and_sinks(backend, case):
    heads, kv_heads, head_dim, block_size, window, with_sinks = CASES[case]
    gen = torch.Generator().manual_seed(6)
    seqs = [(5, 5), (13, 4), (9, 1), (21, 21), (40, 3)]  # (context, new tokens)
    ctx_lens, q_lens = [c for c, _ in seqs], [n for _, n in seqs]
    _, k_cache, v_cache = make_cache(40, block_size, kv_heads, head_dim, torch.float32, gen)
    tables, ks, vs = fill_sequences(k_cache, v_cache, ctx_lens, gen)
    q, k_new, v_new = packed_qkv(sum(q_lens), heads, kv_heads, head_dim, torch.float32, gen)
    cu = [0]
    for i, n in enumerate(q_lens):
        k_new[cu[-1]:cu[-1] + n], v_new[cu[-1]:cu[-1] + n] = ks[i][-n:], vs[i][-n:]
        cu.append(cu[-1] + n)
    sinks = _sinks(heads, gen, with_sinks)
    scale = 0.8 / head_dim ** 0.5
    out = get_ops(backend).prefill_attention(
        q, k_new, v_new, k_cache, v_cache, torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE), tables, scale,
        window=window, sinks=sinks)
    ref = torch.cat([reference(q[cu[i]:cu[i + 1]], ks[i], vs[i], scale, window, sinks)
                     for i in range(len(seqs))])
    assert_close(out, ref, torch.float32)


def test_triton_window_skips_whole_key_tiles():
    """A 200-token prompt with window 5: the Triton kernel's later query tiles start their key
    loops past the first BLOCK_N keys; every row must still see exactly its window."""
    ops = get_ops("triton")
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, block_size, ctx = 2, 1, 16, 16, 200
    _, k_cache, v_cache = make_cache(14, block_size, kv_heads, head_dim, torch.float32, gen)
    tables, ks, vs = fill_sequences(k_cache, v_cache, [ctx], gen)
    q, _, _ = packed_qkv(ctx, heads, kv_heads, head_dim, torch.float32, gen)
    sinks = _sinks(heads, gen, True)
    as_i32 = lambda *xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    for prefix in (0, 150):  # all new / a long cached prefix
        out = ops.prefill_attention(q[prefix:], ks[0][prefix:], vs[0][prefix:], k_cache, v_cache,
                                    as_i32(0, ctx - prefix), as_i32(ctx), tables, 0.25, window=5,
                                    sinks=sinks)
        assert_close(out, reference(q[prefix:], ks[0], vs[0], 0.25, 5, sinks), torch.float32)
