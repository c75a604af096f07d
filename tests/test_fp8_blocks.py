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
    for layer in ref.model.layers[1:]:
        layer.mlp.experts.forward = types.MethodType(_fp8_experts_forward, layer.mlp.experts)
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
    llm = LLM(str(fp8), num_kv_blocks=64, device="cpu")  # the CPU kernels, also where a GPU is
    experts = llm.engine.model.layers[1].mlp.experts
    fused_calls = count_fused_calls(Fp8Experts, monkeypatch)
    prompt = [(7 * i) % 200 + 3 for i in range(21)]
    cpu = llm.engine.prompt_logits(prompt)
    assert not fused_calls
    cuda = cuda_path_logits(fp8, llm, prompt, monkeypatch)
    assert fused_calls and isinstance(experts, Fp8Experts)
    assert (cuda - cpu).abs().max().item() < 1e-3 * cpu.abs().max().item()


def _reference_with_fp8_experts(dequantized):
    ref, _ = fp8_reference(dequantized, _kept_fp8)
    for layer in ref.model.layers[1:]:
        layer.mlp.experts.forward = types.MethodType(_fp8_experts_forward, layer.mlp.experts)
    return ref


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp-experts", "ep-experts"])
def test_tp2_keeps_fp8_and_matches_plain_torch_reference(tmp_path, expert_parallel):
    """TP 2 splits every FP8 layer on whole blocks of 128 columns (o_proj's 4 heads x 64, the
    dense MLP's 512 and the experts' 256 intermediate columns; or, with expert parallelism, half
    of the experts whole), so each rank quantizes its activations in the groups TP 1 does:
    logits and greedy tokens as the plain torch reference."""
    src = make_deepseek(tmp_path, "deepseek_v3", num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                        moe_intermediate_size=256, v_head_dim=64)
    fp8, dequantized = write_fp8(src, tmp_path)
    llm = LLM(str(fp8), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, num_kv_blocks=64)
    try:
        model = llm.engine.model
        experts, o_proj = model.layers[1].mlp.experts, model.layers[0].self_attn.o_proj
        kept_columns = 256 if expert_parallel else 128
        assert isinstance(experts, Fp8Experts) and experts.gate_up_scale.shape[0] == 8 // (1 + expert_parallel)
        assert experts.down_proj.shape[2] == kept_columns == experts.down_scale.shape[2] * BLOCK
        assert o_proj.weight.dtype == torch.uint8 and o_proj.weight.shape[1] == 128 == o_proj.weight_scale.shape[1] * BLOCK
        assert_matches_quantized_reference(llm, _reference_with_fp8_experts(dequantized), "deepseek fp8 at tp 2")
    finally:
        llm.close()


def test_a_split_inside_a_block_of_128_is_refused(checkpoints):
    _, fp8, _ = checkpoints  # 320 intermediate columns: 160 a rank at TP 2
    check_tp_support(load_hf_config(fp8), 2)
    with pytest.raises(ValueError, match="needs whole blocks of 128 columns a rank"):
        LLM(str(fp8), tensor_parallel_size=2, num_kv_blocks=8)


def test_other_quantization_of_deepseek_is_refused(checkpoints, tmp_path):
    _, fp8, _ = checkpoints
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
