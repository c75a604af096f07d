"""FP8 block checkpoints as DeepSeek-V3 and Qwen3 ship them (quant_method fp8, 128x128
weight_block_size, weight_scale_inv, dynamic activations), written here from random models:
every Linear but the router, the embedding and the LM head in e4m3 with one scale per 128x128
block. pdserve keeps them FP8 (activations quantized per token in groups of 128 columns), except
DeepSeek's kv_b_proj, which it dequantizes at load. The reference applies exactly that in plain
torch: transformers' model on the dequantized weights, with the kept Linears' inputs, and each
routed expert's two inputs, quantized and dequantized."""
from __future__ import annotations

import json
import logging
import types

import pytest
import torch
import torch.nn.functional as F
from family_models import count_fused_calls, cuda_path_logits
from test_act_quant import _quant_dequant, assert_matches_quantized_reference
from torch import nn

from pdserve import LLM
from pdserve.executor.setup import check_tp_support
from pdserve.layers.quant.act_quant import Fp8LinearMethod
from pdserve.models.loader import ModelLoadError, load_hf_config
from pdserve.models.moe_quant import Fp8Experts
from pdserve.testing.model_factory import load_reference, make_deepseek, make_model
from pdserve.testing.quant_checkpoints import BLOCK, is_block_quantized, write_fp8

SHAPE = dict(hidden_size=256, intermediate_size=320)  # several column blocks, a ragged last one


def _kept_fp8(name: str) -> bool:
    return not name.endswith("kv_b_proj")


def _fp8_experts_forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """transformers' DeepSeek-V3 experts, token by token, each projection's input quantized."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = F.linear(_quant_dequant(x[t:t + 1], "float", BLOCK), self.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.silu(gate) * up
            out[t] += weights[t, k] * F.linear(_quant_dequant(h, "float", BLOCK), self.down_proj[e])[0]
    return out


def fp8_reference(dequantized, kept) -> tuple[nn.Module, int]:
    """transformers' model on the dequantized weights, the inputs of the Linears kept FP8
    quantized per token and group of 128 columns; and how many Linears that is."""
    ref = load_reference(dequantized)
    count = 0
    for name, module in ref.named_modules():
        if isinstance(module, nn.Linear) and is_block_quantized(f"{name}.weight", module.weight) and kept(name):
            module.register_forward_pre_hook(lambda m, args: (_quant_dequant(args[0], "float", BLOCK),))
            count += 1
    return ref, count


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsfp8")
    src = make_deepseek(root, "deepseek_v3", num_hidden_layers=2, **SHAPE)
    return (src, *write_fp8(src, root))


def test_fp8_blocks_match_plain_torch_reference(checkpoints, caplog):
    _, fp8, dequantized = checkpoints
    ref, kept = fp8_reference(dequantized, _kept_fp8)
    assert kept == 2 * 4 + 3 + 3  # MLA's four FP8 projections per layer, a dense MLP, the shared experts
    experts = ref.model.layers[1].mlp.experts
    experts.forward = types.MethodType(_fp8_experts_forward, experts)
    with caplog.at_level(logging.WARNING, logger="pdserve.quant"):
        llm = LLM(str(fp8), num_kv_blocks=64)
    assert "dequantized to float at load" in caplog.text
    model = llm.engine.model
    assert isinstance(model.layers[1].mlp.experts, Fp8Experts)
    assert model.layers[1].mlp.experts.down_proj.dtype == torch.uint8
    for linear in (model.layers[0].self_attn.q_a_proj, model.layers[0].self_attn.o_proj,
                   model.layers[0].mlp.gate_up_proj, model.layers[1].mlp.shared_expert.down_proj):
        assert isinstance(linear.quant_method, Fp8LinearMethod) and linear.weight.dtype == torch.uint8
    assert_matches_quantized_reference(llm, ref, "deepseek fp8")


def test_the_cuda_path_gives_the_cpu_paths_logits(checkpoints, monkeypatch):
    """DeepSeek-V3 FP8 through its CUDA kernels (the dense FP8 layers' block GEMM and the routed
    experts' two grouped GEMMs; forced on CPU under the Triton interpreter where no GPU is)
    against the CPU kernels."""
    _, fp8, _ = checkpoints
    llm = LLM(str(fp8), num_kv_blocks=64)
    experts = llm.engine.model.layers[1].mlp.experts
    fused_calls = count_fused_calls(Fp8Experts, monkeypatch)
    prompt = [(7 * i) % 200 + 3 for i in range(21)]
    cpu = llm.engine.prompt_logits(prompt)
    assert not fused_calls
    cuda = cuda_path_logits(fp8, llm, prompt, monkeypatch)
    assert fused_calls and isinstance(experts, Fp8Experts)
    assert (cuda - cpu).abs().max().item() < 1e-3 * cpu.abs().max().item()


def test_other_quantization_of_deepseek_is_refused(checkpoints, tmp_path):
    _, fp8, _ = checkpoints
    with pytest.raises(ValueError, match="quantized DeepseekV3ForCausalLM checkpoints .* tensor_parallel_size 1"):
        check_tp_support(load_hf_config(fp8), 2)
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (tmp_path / "config.json").write_text(json.dumps(config))
    for f in fp8.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    with pytest.raises(ModelLoadError, match="activation_scheme 'static' is not supported.*DeepSeek-V3"):
        LLM(str(tmp_path), num_kv_blocks=8)


def test_qwen3_fp8_blocks_match_plain_torch_reference(tmp_path):
    """Qwen3's FP8 checkpoints: the same format on the Llama family's fused layers (k and v of 64
    rows each: the block scales of a part smaller than a block, side by side in qkv_proj)."""
    src = make_model(tmp_path, "qwen3", **SHAPE)
    fp8, dequantized = write_fp8(src, tmp_path)
    ref, kept = fp8_reference(dequantized, lambda name: True)
    assert kept == 2 * 7
    llm = LLM(str(fp8), num_kv_blocks=64)
    layer = llm.engine.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear.quant_method, Fp8LinearMethod) and linear.weight.dtype == torch.uint8
    assert_matches_quantized_reference(llm, ref, "qwen3 fp8")
