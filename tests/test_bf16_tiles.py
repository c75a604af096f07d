"""Unquantized weights' products on AMX tiles laid out once (native_matrices.bf16_tiles): the
compiled gemv given the pack gives the products it gives without it, bit for bit, for bf16 rows
and float32 rows alike; the Python layers and the LM head past 16 rows take it; and an engine on a
bf16 checkpoint, its decode steps of more than 16 rows on the tiles, keeps float32's greedy tokens
until a near tie. Needs AMX: skipped elsewhere."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.kernels import dequant_tiles, native_gemv
from pdserve.kernels.native_matrices import bf16_matrix, bf16_tiles, float_matrix
from pdserve.layers.quant.unquantized import UnquantizedLinearMethod
from pdserve.layers.vocab import ParallelLMHead
from pdserve.testing.model_factory import (
    assert_agrees_until_a_near_tie,
    assert_greedy_matches_reference,
    load_reference,
    make_model,
)

pytestmark = pytest.mark.skipif(not dequant_tiles.native_amx() or native_gemv.library() is None,
                                reason="no AMX tiles or no compiled gemv on this machine")


@pytest.fixture
def bf16_products():
    """bf16 tile products for the test (conftest.py puts this process's dtype back after it)."""
    dequant_tiles.set_tile_dtype(torch.bfloat16)


def _run(x: torch.Tensor, matrix: tuple, rows: int) -> torch.Tensor:
    out = torch.empty(x.shape[0], rows)
    assert native_gemv.run(x.data_ptr(), x.shape[0], x.shape[1], matrix, out.data_ptr())
    return out


@pytest.mark.parametrize("tokens", [9, 40, 130])
def test_the_pack_gives_the_products_of_the_rows_it_packs(bf16_products, tokens):
    """70 rows (the last task of 32 padded), 192 columns: from the pack and from the rows (copied and
    transposed a call) the same float32 sums, for bf16 rows and for float32 rows rounded to bf16."""
    gen = torch.Generator().manual_seed(tokens)
    weight = torch.randn(70, 192, generator=gen)
    x = torch.randn(tokens, 192, generator=gen)
    rows = weight.to(torch.bfloat16)
    tiles = bf16_tiles(rows)
    assert tiles is not None and tiles.numel() == 96 * 192 * 2 and tiles.data_ptr() % 64 == 0
    from_rows = _run(x, bf16_matrix(rows), 70)
    assert torch.equal(_run(x, bf16_matrix(rows, tiles), 70), from_rows)
    assert torch.equal(_run(x, float_matrix(weight, tiles), 70), _run(x, float_matrix(weight), 70))
    exact = x.to(torch.bfloat16).double() @ rows.double().T
    assert torch.allclose(from_rows.double(), exact, rtol=1e-5, atol=1e-4)  # (bf16 operands, float32 sums)


def test_python_layers_and_the_lm_head_take_the_tiles_past_16_rows(bf16_products):
    """A linear layer and a tied LM head at 40 rows: bf16 products read from the layer's pack (made
    once, kept), equal to the gemv's products from the rows; at 16 rows or under float32 products no
    pack is made."""
    gen = torch.Generator().manual_seed(5)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(96, 128, generator=gen).to(torch.bfloat16).float(),
                                      requires_grad=False)
    x = torch.randn(40, 128, generator=gen)
    got = UnquantizedLinearMethod().apply(layer, x, None)
    tiles = layer.__dict__["_bf16_tiles"][1]
    assert tiles is not None
    assert torch.equal(got, _run(x, bf16_matrix(layer.weight.to(torch.bfloat16)), 96))
    UnquantizedLinearMethod().apply(layer, x, None)
    assert layer.__dict__["_bf16_tiles"][1] is tiles  # made once
    head = ParallelLMHead(96, 128)
    head.weight.data.copy_(layer.weight)
    assert torch.equal(head(x), got)
    assert "_bf16_tiles" in head.__dict__
    dequant_tiles.set_tile_dtype(torch.float32)
    fresh = ParallelLMHead(96, 128)
    fresh.weight.data.copy_(layer.weight)
    assert torch.allclose(fresh(x).double(), x.double() @ layer.weight.double().T, atol=1e-4)
    assert fresh.__dict__.get("_bf16_tiles", (0, None))[1] is None


def _bf16_checkpoint(tmp_path):
    """A random Llama saved again in bf16 over itself (the tokenizer's files stay)."""
    path = make_model(tmp_path, "llama")
    AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).save_pretrained(str(path))
    return path


@pytest.mark.skipif(not dequant_tiles.avx512_bf16(), reason="the norm's rounding needs AVX-512 BF16")
def test_prefill_past_the_tiles_rows_keeps_bf16_between_norms_and_products(tmp_path, monkeypatch):
    """A bf16 checkpoint's 600-token prompt (past the tiles' 512 rows: oneDNN's bf16 passes): the
    norms round their rows and the products take and give bf16 (layers/bf16_rows.py, the MLP in one
    pass, qkv's rows widened and rotated in one), and its logits equal, bit for bit, the same engine's with float32 rows in between."""
    from pdserve.kernels import numba_fused
    from pdserve.layers import bf16_rows
    llm = LLM(str(_bf16_checkpoint(tmp_path)), num_kv_blocks=64, cpu_gemm_dtype="bfloat16",
              enable_prefix_caching=False, max_num_batched_tokens=1024)
    prompt = torch.randint(3, 200, (600,), generator=torch.Generator().manual_seed(5)).tolist()
    calls, roped = [], []
    rounding_norm, widen_rope = numba_fused.rms_norm_low, numba_fused.widen_rope
    monkeypatch.setattr(numba_fused, "rms_norm_low", lambda *a, **k: calls.append(1) or rounding_norm(*a, **k))
    monkeypatch.setattr(numba_fused, "widen_rope", lambda *a, **k: roped.append(1) or widen_rope(*a, **k))
    got = llm.engine.prompt_logits(prompt)
    assert len(calls) == 2 * len(llm.engine.runner.model.layers)
    assert len(roped) == len(llm.engine.runner.model.layers)  # qkv's bf16 rows widened and rotated at once
    monkeypatch.setattr(bf16_rows, "step_takes", lambda *a: False)
    assert torch.equal(got, llm.engine.prompt_logits(prompt))


def test_a_bf16_checkpoint_decodes_many_rows_on_the_tiles(tmp_path, bf16_products):
    """A Llama saved in bf16, 20 prompts decoded together (steps of 20 rows: the compiled step's
    products and the LM head on the tiles): float32 products give transformers' greedy tokens, bf16
    products on the tiles agree with them until a near tie, and every matrix has its pack."""
    path = _bf16_checkpoint(tmp_path)
    ref = load_reference(path)
    prompts = [[(11 * i + 7 * n) % ref.config.vocab_size for i in range(n)] for n in range(12, 32)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    runs = {}
    for name in ("float32", "bfloat16"):
        llm = LLM(str(path), num_kv_blocks=128, cpu_gemm_dtype=name, enable_prefix_caching=False)
        if name == "float32":
            assert_greedy_matches_reference(llm, ref, prompts[:3], 10, name)
        runs[name] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), UnquantizedLinearMethod)]
    assert linears and all(m.__dict__.get("_bf16_tiles", (0, None))[1] is not None for m in linears)
    assert model.lm_head.__dict__.get("_bf16_tiles", (0, None))[1] is not None
    assert_agrees_until_a_near_tie(runs["float32"], runs["bfloat16"], 0.05)
