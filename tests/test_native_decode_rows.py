"""The compiled decode step (pdserve.kernels.native_decode) past a plain Llama's one-token decodes:
speculation's verify rows (a request's last token and its k drafts, causal among themselves over
the paged cache) and the Qwen layers (Qwen2's qkv bias, Qwen3's per-head QK norms). Each takes the
compiled path, gives transformers' greedy tokens on the dequantized GGUF, and logprobs within 1e-4
of the same engine running the layers in Python. Each also fails when the C code drops the op
that sets it apart (the causal limit among verify rows, the bias, the QK norms): those checks were
made by breaking native_decode.c and running these tests."""
from __future__ import annotations

import random

import gguf
import pytest
import test_gguf
import torch
from test_gguf import reference
from test_native_decode import _llm, compare_with_python_layers, logprobs, pytestmark  # noqa: F401
from transformers import AutoModelForCausalLM

from pdserve.testing.model_factory import assert_greedy_matches_reference

Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def _private_cache(private_cache):
    """conftest's: a private PDSERVE_CACHE_DIR sharing the compiled kernels"""


def _repeating(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """Prompts that repeat their first half: the n-gram lookup finds drafts in them."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        p = [rng.randrange(3, 250) for _ in range(n)]
        out.append(p + p[: n // 2])
    return out


def test_verify_rows_take_the_compiled_step(tmp_path):
    """The model drafts for itself (random models agree with no other drafter): every draft is
    accepted, so every verify row's token is in the output, each row's logits seen by the check."""
    path = _llm(tmp_path)[1]
    llm, _ = _llm(tmp_path, speculative_config={"method": "draft_model", "model": str(path),
                                                "num_speculative_tokens": 3})
    native, stats = llm.engine.model.native_decode, llm.engine.speculator.stats
    prompts = _repeating(1, (12, 30, 21))
    steps, rows = native.steps, native.rows
    logprobs(llm, prompts[:1], new_tokens=16)  # one request: a step of more rows is a verify step
    assert native.rows - rows > native.steps - steps
    assert stats.num_accepted_tokens > 0
    _, ref = reference(path)
    assert_greedy_matches_reference(llm, ref, prompts, 16)
    compare_with_python_layers(llm, prompts)  # three requests' verify rows in one step


class _BiasedModels:
    """transformers' AutoModelForCausalLM for write_gguf, with random biases and norm weights
    where its initialisation leaves zeros and ones (a zero bias would not tell the C code's
    bias from none)."""

    @staticmethod
    def from_config(config):
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias") or name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.copy_(torch.randn_like(p) * 0.5 + (0 if name.endswith(".bias") else 1))
        return model


@pytest.mark.parametrize("arch,qtype", [("qwen2", Q.Q4_1), ("qwen3", Q.Q8_0)])
def test_qwen_layers_take_the_compiled_step(tmp_path, monkeypatch, arch, qtype):
    """Qwen2: q, k and v biases. Qwen3: RMSNorm over each head of q and k before RoPE."""
    with monkeypatch.context() as patch:
        patch.setattr(test_gguf, "AutoModelForCausalLM", _BiasedModels)
        llm, path = _llm(tmp_path, arch, qtype)
    native = llm.engine.model.native_decode
    assert native is not None
    steps = native.steps
    _, ref = reference(path)
    assert_greedy_matches_reference(llm, ref, _repeating(2, (5, 19)), 12, arch)
    assert native.steps > steps
    compare_with_python_layers(llm)
