"""compressed-tensors checkpoints that quantize activations: FP8 (per-channel weights with
dynamic per-token activations, and 128x128 block weights with per-token groups of 128) and W8A8
int8 (per-channel weights, dynamic per-token activations). Written here with compressed-tensors
from a random Llama; pdserve keeps the weights 8-bit and must give the greedy tokens of a
plain-torch reference that applies the same quantization: transformers' Llama with each quantized
Linear's weight replaced by the checkpoint's dequantized values and its input quantized and
dequantized per token (or per token and group) before the matmul. (How far each format moves
a real model from its float32 tokens: benchmarks/engine/bench_act_quant_agreement.py.)"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from pdserve import LLM
from pdserve.layers.quant.act_quant import Fp8LinearMethod, Int8LinearMethod
from pdserve.models.loader import ModelLoadError
from pdserve.testing.model_factory import assert_greedy_matches_reference, load_reference, make_model
from pdserve.testing.quant_checkpoints import PRESETS, write_act_quant

NEW_TOKENS = 16
SHAPE = dict(hidden_size=256, intermediate_size=320)  # 320: a ragged last 128-column block


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("act"), "llama", **SHAPE)


def _quant_dequant(x: torch.Tensor, kind: str, group: int | None) -> torch.Tensor:
    """The activations' dynamic symmetric quantization, per token (group None) or per token and
    group of columns, written out in plain torch."""
    shape = x.shape
    cols = shape[-1]
    group = group or cols
    pad = -cols % group
    g = torch.nn.functional.pad(x.reshape(-1, cols), (0, pad)).reshape(-1, (cols + pad) // group, group)
    top = 448.0 if kind == "float" else 127.0
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / top
    if kind == "float":
        q = (g / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    else:
        q = (g / scale).round().clamp(-128, 127)
    return (q * scale).reshape(-1, cols + pad)[:, :cols].reshape(shape)


def quantized_reference(path, src):
    """transformers' Llama with the checkpoint's dequantized weights and quantized inputs."""
    ref = load_reference(src)
    tensors = load_file(str(path / "model.safetensors"))
    weights = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    kind, block = weights["weights"]["type"], weights["weights"].get("block_structure")
    for name, module in ref.named_modules():
        if not isinstance(module, nn.Linear) or f"{name}.weight_scale" not in tensors:
            continue
        q, scale = tensors[f"{name}.weight"].float(), tensors[f"{name}.weight_scale"]
        if block:
            scale = scale.repeat_interleave(block[0], 0)[:q.shape[0]].repeat_interleave(block[1], 1)[:, :q.shape[1]]
        module.weight.data.copy_(q * scale)
        group = block[1] if block else None
        module.register_forward_pre_hook(lambda m, args, group=group: (_quant_dequant(args[0], kind, group),))
    return ref


def _prompts(seed: int, vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def assert_matches_quantized_reference(llm, ref, what: str) -> None:
    """Prompt logits equal the reference's up to the order of float32 sums, and greedy tokens are
    identical. Quantizing an activation is a step function: an input that lands within a rounding
    of a step (its sums ordered differently) rounds the other way at a few positions, which moves
    their logits by up to a few tenths; so most positions, not all, must agree to 1e-3."""
    prompts = _prompts(2, ref.config.vocab_size, (6, 19, 40))
    diffs = []
    for prompt in prompts:
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0]
        diffs.append((llm.engine.prompt_logits(prompt) - theirs).abs().amax(-1))
    diffs = torch.cat(diffs)
    assert (diffs < 1e-3).float().mean() >= 0.9 and diffs.max() < 1.0, f"{what}: logit diffs {diffs.tolist()}"
    assert_greedy_matches_reference(llm, ref, prompts, NEW_TOKENS, what)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_matches_plain_torch_reference(tmp_path, source, preset):
    path = write_act_quant(tmp_path, source, preset)
    llm = LLM(str(path), num_kv_blocks=64)
    layer = llm.engine.model.layers[0]
    method = Int8LinearMethod if preset == "W8A8" else Fp8LinearMethod
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert type(linear.quant_method) is method
        assert linear.weight.element_size() == 1
    assert_matches_quantized_reference(llm, quantized_reference(path, source), preset)


def test_unsupported_activation_schemes_are_refused(tmp_path, source):
    path = write_act_quant(tmp_path, source, "W8A8")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="static activation scales.*W4A16 and W8A16.*FP8.*W8A8"):
        LLM(str(path), num_kv_blocks=8)
