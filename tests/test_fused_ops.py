"""The fused layer ops (residual add + RMSNorm, in-place RoPE, SiLU * up), Triton's and numba's,
against the torch modules they replace in pdserve.models.llama, and a whole model with them
against transformers.

Triton's run on CUDA when there is one, else under TRITON_INTERPRET=1 (conftest.py); numba's on
CPU (other dtypes and devices go through the torch ops). Inputs are strided views of packed
tensors, as the model hands them over.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import numba_fused, triton_fused
from pdserve.models.llama import RMSNorm
from pdserve.models.rope import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Two units in the last place of each dtype: the kernels round where the modules do, but a
# float32 sum in another order (or exp/rsqrt a last bit apart) can tip one rounding, and the
# next op's rounding may carry that one unit on.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
FUSED = {"triton": triton_fused, "numba": numba_fused}


def _close(got, want, dtype):
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 200])
@pytest.mark.parametrize("fused", FUSED)
def test_add_rms_norm_matches_residual_add_then_rmsnorm(fused, dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen) * 0.3 + 1)
    packed = (torch.randn(9, 3 * hidden, generator=gen) * 2).to(DEVICE, dtype)
    x, delta = packed[:, :hidden], packed[:, hidden:2 * hidden]  # strided rows
    with torch.no_grad():
        summed, normed = FUSED[fused].rms_norm(x, norm.weight, norm.eps, delta=delta)
        _close(summed, x + delta, dtype)
        _close(normed, norm(x + delta), dtype)
        same, normed_only = FUSED[fused].rms_norm(x, norm.weight, norm.eps)
        assert same is x
        _close(normed_only, norm(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 6, 64), (8, 1, 32)])
@pytest.mark.parametrize("fused", FUSED)
def test_rope_in_place_matches_rotary_embedding(fused, dtype, heads, kv_heads, head_dim):
    from transformers import LlamaConfig
    gen = torch.Generator().manual_seed(head_dim)
    rope = RotaryEmbedding(LlamaConfig(rope_theta=10000.0), head_dim, 512).to(torch.device(DEVICE))
    tokens = 7
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    positions = torch.tensor([0, 1, 5, 17, 100, 300, 511], device=DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)
    want_q, want_k = RotaryEmbedding.apply(q, k, cos, sin)
    FUSED[fused].rope_(q, k, cos, sin)
    _close(q, want_q, dtype)
    _close(k, want_k, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 1100])
@pytest.mark.parametrize("fused", FUSED)
def test_silu_mul_matches_torch(fused, dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(5, 2 * inter, generator=gen) * 3).to(DEVICE, dtype)
    gate, up = gate_up.split(inter, dim=-1)
    _close(FUSED[fused].silu_mul(gate_up), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_model_with_fused_ops_matches_transformers_logits(tmp_path, kind):
    """Every position's logits of a prompt, fused model against transformers in float32."""
    from pdserve import LLM
    from pdserve.testing.model_factory import load_reference, make_model
    path = make_model(tmp_path, kind)
    llm = LLM(model=str(path), dtype="float32", device=DEVICE, kernel_backend="triton",
              num_kv_blocks=64, enforce_eager=True)
    llm.engine.model.fused = triton_fused  # on CPU the runner leaves the torch ops in place
    prompt = [(i * 37) % 250 + 3 for i in range(40)]
    got = llm.engine.prompt_logits(prompt)
    ref = load_reference(path).to(DEVICE)
    with torch.no_grad():
        want = ref(torch.tensor([prompt], device=DEVICE)).logits[0].float()
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_cpu_model_runs_numba_fused_ops_and_matches_transformers_logits(tmp_path):
    """The numba backend on CPU puts the numba ops in the layers; float32 logits as transformers'."""
    from pdserve import LLM
    from pdserve.testing.model_factory import load_reference, make_model
    path = make_model(tmp_path, "llama")
    llm = LLM(model=str(path), dtype="float32", device="cpu", kernel_backend="numba", num_kv_blocks=64)
    assert llm.engine.model.fused is numba_fused
    prompt = [(i * 37) % 250 + 3 for i in range(40)]
    got = llm.engine.prompt_logits(prompt)
    with torch.no_grad():
        want = load_reference(path)(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
