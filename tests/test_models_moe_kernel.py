"""The Triton grouped-GEMM MoE (kernels/triton_moe.py; the interpreter without a GPU) against
models.moe.Experts' torch path: Qwen-style SwiGLU experts and gpt-oss's biased clamped ones,
skewed routing (experts with no tokens, one expert with most), 1 to 37 tokens, and the tile
layout itself."""
from __future__ import annotations

import functools

import pytest
import torch

from pdserve.kernels.triton_moe import BLOCK_M, fused_experts, tile_layout
from pdserve.models.moe import Experts, clamped_swiglu, silu_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _experts(num_experts, hidden, inter, bias, activation, gen):
    ex = Experts(num_experts, hidden, inter, bias, activation)
    for p in ex.parameters():
        p.data = (0.3 * torch.randn(p.shape, generator=gen)).to(DEVICE)
    return ex


@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("kind", ["swiglu", "gpt-oss"])
def test_fused_experts_match_torch_experts(kind, tokens):
    gen = torch.Generator().manual_seed(tokens)
    num_experts, hidden, inter, top_k = 6, 32, 24, 2
    act = silu_mul if kind == "swiglu" else functools.partial(clamped_swiglu, alpha=1.702, limit=1.5)
    ex = _experts(num_experts, hidden, inter, kind == "gpt-oss", act, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    # Skewed: expert 4 gets most pairs, experts 1 and 5 none.
    logits = torch.randn(tokens, num_experts, generator=gen) + torch.tensor([0, -9, 0, 0, 3, -9.0])
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    with torch.no_grad():
        want = ex(x, ids, weights)
        got = fused_experts(x, ids, weights, ex.gate_up_proj, ex.down_proj, act,
                            ex.gate_up_bias, ex.down_bias)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tile_layout_puts_each_expert_in_its_own_tiles():
    ids = torch.tensor([[2, 0], [2, 3], [2, 0]] + [[2, 3]] * 14)
    pair_ids, tile_expert = tile_layout(ids, 5)
    flat = ids.reshape(-1)
    tiles = pair_ids.view(-1, BLOCK_M)
    assert tiles.shape[0] == tile_expert.numel() == -(-flat.numel() // BLOCK_M) + 5
    seen = []
    for tile, expert in zip(tiles.tolist(), tile_expert.tolist()):
        pairs = [p for p in tile if p >= 0]
        if expert == 5:  # unused tiles hold no pair
            assert not pairs
            continue
        assert pairs and all(flat[p] == expert for p in pairs)
        seen += pairs
    assert sorted(seen) == list(range(flat.numel()))


def test_expert_loop_fallback_matches_grouped_matmul(monkeypatch):
    """Where torch has no _grouped_mm (and on CUDA without Triton) experts run one by one."""
    gen = torch.Generator().manual_seed(9)
    act = functools.partial(clamped_swiglu, alpha=1.702, limit=1.5)
    ex = _experts(5, 16, 8, True, act, gen).cpu()
    x = torch.randn(9, 16, generator=gen)
    weights, ids = torch.randn(9, 5, generator=gen).softmax(-1).topk(2, dim=-1)
    with torch.no_grad():
        grouped = ex(x, ids, weights)
        monkeypatch.delattr(torch, "_grouped_mm")
        looped = ex(x, ids, weights)
    torch.testing.assert_close(looped, grouped, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("tokens", [1, 9])
def test_small_group_kernel_matches_grouped_matmul(monkeypatch, tokens):
    """CPU decode steps (few rows per expert) run the compiled kernel (kernels/numba_moe.py);
    it gives _grouped_mm's results, with biases, a skewed routing and experts with no rows."""
    pytest.importorskip("numba")
    from pdserve.models import moe
    gen = torch.Generator().manual_seed(tokens)
    act = functools.partial(clamped_swiglu, alpha=1.702, limit=1.5)
    ex = _experts(6, 32, 24, True, act, gen).cpu()
    x = torch.randn(tokens, 32, generator=gen)
    logits = torch.randn(tokens, 6, generator=gen) + torch.tensor([0, -9, 0, 0, 3, -9.0])
    weights, ids = logits.softmax(-1).topk(2, dim=-1)
    assert ex._cpu_grouped_matmul(x, ids.numel()) is moe._numba_moe().grouped_small_mm
    with torch.no_grad():
        compiled = ex(x, ids, weights)
        monkeypatch.setattr(moe, "_numba_moe", lambda: None)
        grouped = ex(x, ids, weights)
    torch.testing.assert_close(compiled, grouped, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows_per_expert", [[0, 1, 2, 3, 4, 5, 0, 9], [13, 0, 0, 1, 0, 0, 0, 7]])
def test_small_group_kernel_blocks_of_rows_and_weight_rows(rows_per_expert):
    """The compiled kernel works in blocks of four rows (a short block repeats its last row)
    and of ROWS_PER_ITEM weight rows: row counts that are not multiples of four and an output
    width that is not a multiple of ROWS_PER_ITEM give _grouped_mm's result, row for row."""
    pytest.importorskip("numba")
    from pdserve.kernels import numba_moe
    gen = torch.Generator().manual_seed(sum(rows_per_expert))
    n_out = 2 * numba_moe.ROWS_PER_ITEM + 22
    weight = torch.randn(len(rows_per_expert), n_out, 40, generator=gen)
    rows = torch.randn(sum(rows_per_expert), 40, generator=gen)
    offs = torch.tensor(rows_per_expert).cumsum(0).to(torch.int32)
    got = numba_moe.grouped_small_mm(rows, weight, offs)
    want = torch._grouped_mm(rows, weight.transpose(1, 2), offs=offs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
