"""GGUF weights kept quantized: each kept type decodes to exactly gguf-py's float32 values, both
matmul paths of the CPU kernels agree with a float32 matmul over those values, and a Llama
written in each type (and in a llama.cpp-style mix of types) generates the same greedy tokens as
transformers loading the file dequantized, while its layers hold the quantized bytes."""
from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from family_models import cuda_path_logits
from gguf_kquants import quantize
from test_gguf import reference, write_gguf

from pdserve import LLM
from pdserve.kernels import quant_cpu
from pdserve.layers.quant import cuda_kernels
from pdserve.layers.quant.gguf_blocks import KEPT_TYPES, decode
from pdserve.layers.quant.grouped import GroupedLinearMethod, scales_view
from pdserve.testing.model_factory import assert_matches_reference

Q = gguf.GGMLQuantizationType
# K types need rows of 256 columns.
SIZES = dict(hidden_size=256, intermediate_size=512)
NEW_TOKENS = 16


@pytest.fixture(autouse=True)
def _private_cache(private_cache):
    """conftest's: a private PDSERVE_CACHE_DIR sharing the compiled kernels"""


@pytest.mark.parametrize("kind", KEPT_TYPES)
def test_decode_is_exact_and_kernels_agree(kind):
    w = (np.random.default_rng(0).standard_normal((48, 512)) * 0.2).astype(np.float32)
    raw = quantize(w, Q[kind])
    want = gguf.dequantize(raw, Q[kind])
    weight = decode(kind, raw)
    fmt = weight.native_format()
    p = weight.to_params(fmt)
    q, scales = p["qweight"], scales_view(p["scales"])
    mins = scales_view(p["mins"]) if "mins" in p else None
    got = quant_cpu.dequantize_rows(fmt.bits, q, scales, mins, fmt.group).numpy()
    assert np.array_equal(got, want)  # bit for bit: the prefill path multiplies transformers' values
    for tokens in (1, quant_cpu.QUANT_GEMV_MAX_TOKENS, quant_cpu.QUANT_GEMV_MAX_TOKENS + 5):
        x = torch.randn(tokens, 512)
        y = quant_cpu.quant_matmul(x, fmt.bits, q, scales, mins, fmt.group)
        assert (y - x @ torch.from_numpy(want).T).abs().max().item() < 1e-4


def _mixed(name: str):
    """As llama.cpp's Q4_K_M: attn_v and ffn_down in Q6_K, the embedding in Q8_0, the rest Q4_K
    (so the fused qkv layer holds two types in one format)."""
    if "attn_v" in name or "ffn_down" in name:
        return Q.Q6_K
    return Q.Q8_0 if name.startswith("token_embd") else Q.Q4_K


@pytest.mark.parametrize("kind", [*KEPT_TYPES, "mixed"])
def test_kept_quantized_matches_transformers(tmp_path, kind):
    qtype = _mixed if kind == "mixed" else Q[kind]
    path = write_gguf(tmp_path / f"m.{kind}.gguf", "llama", qtype, dims=SIZES, quantize=quantize)
    _, ref = reference(path)
    llm = LLM(str(path), num_kv_blocks=64)
    model = llm.engine.model
    methods = [m.quant_method for m in model.modules() if getattr(m, "quant_method", None) is not None]
    assert methods and all(isinstance(m, GroupedLinearMethod) for m in methods)
    assert model.lm_head.qweight is model.embed_tokens.qweight  # tied, one copy
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes < 0.4 * sum(p.numel() * 4 for p in ref.parameters())
    assert_matches_reference(llm, ref, 1, (5, 17, 40), NEW_TOKENS, 1e-3)


def test_the_cuda_path_gives_the_cpu_paths_logits(tmp_path, monkeypatch):
    """The llama.cpp-style mix (Q4_K, Q6_K's groups of 16, a Q8_0 embedding and tied LM head)
    through the grouped Triton GEMM and row lookups (on the GPU where there is one, else forced
    on CPU under the Triton interpreter) against the CPU kernels."""
    path = write_gguf(tmp_path / "m.mixed.gguf", "llama", _mixed, dims=SIZES, quantize=quantize)
    llm = LLM(str(path), num_kv_blocks=64, device="cpu")  # the CPU kernels, also where a GPU is
    prompt = [(7 * i) % 200 + 3 for i in range(13)]
    cpu = llm.engine.prompt_logits(prompt)
    calls = []
    for name in ("grouped_apply", "grouped_rows"):
        kernel = getattr(cuda_kernels, name)
        monkeypatch.setattr(cuda_kernels, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    cuda = cuda_path_logits(path, llm, prompt, monkeypatch)
    assert {"grouped_apply", "grouped_rows"} <= set(calls)
    assert (cuda - cpu).abs().max().item() < 1e-3 * cpu.abs().max().item()


def test_other_types_are_dequantized_with_a_log_line(tmp_path, caplog):
    path = write_gguf(tmp_path / "m.Q5_0.gguf", "llama", Q.Q5_0, dims=SIZES)
    with caplog.at_level(logging.WARNING, logger="pdserve.quant"):
        llm = LLM(str(path), num_kv_blocks=16)
    assert any("Q5_0" in r.getMessage() and "dequantized" in r.getMessage() for r in caplog.records)
    assert llm.engine.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
