"""MLA attention over a paged latent cache against a float64 reference that expands every
latent into K/V per head and runs plain softmax attention."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdserve.kernels import mla_ops
from pdserve.models.mla import MLASpec, MLAttention

SPEC = MLASpec(hidden_size=32, num_heads=4, q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=12, attention_bias=False, rope_interleave=True,
               softmax_scale=24 ** -0.5 * 1.3)
BLOCK = 4


@pytest.fixture(scope="module")
def attn():
    torch.manual_seed(0)
    module = MLAttention(SPEC, layer_idx=0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    return module


def reference(attn: MLAttention, q: torch.Tensor, latent: torch.Tensor, q_positions: list[int]) -> torch.Tensor:
    """float64: q [n, heads, qk] (nope | rotated) over latents [ctx, latent_dim], causal by position."""
    s = SPEC
    w = attn.kv_b_proj.weight.double().view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
    c, k_pe = latent.double().split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
    k_nope = torch.einsum("hnl,tl->thn", w[:, :s.qk_nope_head_dim], c)
    v = torch.einsum("hvl,tl->thv", w[:, s.qk_nope_head_dim:], c)
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, s.num_heads, -1)], dim=-1)
    scores = torch.einsum("qhd,thd->hqt", q.double(), k) * s.softmax_scale
    future = torch.arange(latent.shape[0])[None, :] > torch.tensor(q_positions)[:, None]
    probs = scores.masked_fill(future[None], float("-inf")).softmax(-1)
    return torch.einsum("hqt,thv->qhv", probs, v)


def paged_cache(latents: list[torch.Tensor], num_blocks: int = 120):
    """Latents of several sequences written through store_latent into shuffled blocks."""
    cache = torch.zeros(num_blocks, BLOCK, 1, SPEC.latent_dim)
    free = torch.randperm(num_blocks).tolist()
    tables = []
    for lat in latents:
        n = -(-lat.shape[0] // BLOCK)
        ids = [free.pop() for _ in range(n)]
        slots = torch.tensor([ids[t // BLOCK] * BLOCK + t % BLOCK for t in range(lat.shape[0])])
        mla_ops.store_latent(lat, cache, slots)
        tables.append(ids + [0] * (80 - n))
    return cache, torch.tensor(tables, dtype=torch.int32)


def test_store_latent_skips_slot_minus_one():
    cache = torch.zeros(2, BLOCK, 1, 3)
    mla_ops.store_latent(torch.ones(3, 3), cache, torch.tensor([5, -1, 0]))
    assert cache.sum() == 6 and cache[1, 1, 0].sum() == 3 and cache[0, 0, 0].sum() == 3


def _latent_decode(backend: str):
    """The torch op, or the Triton kernel (through the interpreter on CPU)."""
    if backend == "torch":
        return mla_ops.paged_latent_decode
    from pdserve.kernels import get_ops
    return mla_ops.latent_decode_for(get_ops("triton"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_absorbed_decode_matches_float64_expanded_attention(attn, backend):
    torch.manual_seed(1)
    lengths = [1, 5, 17, 300]  # 300: the Triton kernel splits the context (flash-decoding)
    latents = [torch.randn(n, SPEC.latent_dim) for n in lengths]
    cache, tables = paged_cache(latents)
    q = torch.randn(len(lengths), SPEC.num_heads, SPEC.qk_head_dim)
    meta = SimpleNamespace(decode_block_tables=tables, decode_context_lens=torch.tensor(lengths, dtype=torch.int32))
    with torch.no_grad():
        got = attn._decode(q[..., :SPEC.qk_nope_head_dim], q[..., SPEC.qk_nope_head_dim:], cache, meta,
                           _latent_decode(backend))
    for i, n in enumerate(lengths):
        want = reference(attn, q[i:i + 1], latents[i], [n - 1])[0]
        assert (got[i].double() - want).abs().max() < 1e-5, f"sequence of {n} tokens"


def test_prefill_with_cached_prefix_matches_float64(attn):
    """Two sequences in one batch: one without a prefix (its new latents used directly), one
    whose first 13 tokens are only in the cache (read back and expanded)."""
    torch.manual_seed(2)
    latents = [torch.randn(9, SPEC.latent_dim), torch.randn(20, SPEC.latent_dim)]
    cache, tables = paged_cache(latents)
    new_counts = [9, 7]
    q = torch.randn(sum(new_counts), SPEC.num_heads, SPEC.qk_head_dim)
    latent_new = torch.cat([latents[0], latents[1][13:]])
    meta = SimpleNamespace(prefill_cu_seqlens=torch.tensor([0, 9, 16]), prefill_context_lens=torch.tensor([9, 20]),
                           prefill_block_tables=tables)
    with torch.no_grad():
        got = attn._prefill(q, latent_new, cache, meta)
    want0 = reference(attn, q[:9], latents[0], list(range(9)))
    want1 = reference(attn, q[9:], latents[1], list(range(13, 20)))
    assert (got[:9].double() - want0).abs().max() < 1e-5
    assert (got[9:].double() - want1).abs().max() < 1e-5
