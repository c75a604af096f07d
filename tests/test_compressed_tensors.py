"""compressed-tensors W4A16 / W8A16 checkpoints (pack-quantized; group and channel; symmetric
and asymmetric), written here with compressed-tensors from a random Llama, load kept quantized
and generate the greedy tokens of transformers loading them decompressed to float32
(CompressedTensorsConfig(run_compressed=False)). Packed weights whose scheme also quantizes
activations are refused (test_act_quant.py has the FP8 and W8A8 formats that load)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from pdserve import LLM
from pdserve.layers.quant.grouped import GroupedLinearMethod
from pdserve.models.loader import ModelLoadError
from pdserve.testing.model_factory import assert_matches_reference, make_model, save_compressed

NEW_TOKENS = 16


def write_checkpoint(root, bits: int, group_size: int | None, symmetric: bool):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    src = make_model(root, "llama")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                            strategy="group" if group_size else "channel", group_size=group_size)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    for module in model.modules():  # round-to-nearest scales from the weights (weight-only: no data)
        if hasattr(module, "weight_scale"):
            w = module.weight.data
            groups = w.reshape(w.shape[0], -1, group_size or w.shape[1])
            scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    return save_compressed(model, compressor, src, root / f"ct-w{bits}-g{group_size}-{'sym' if symmetric else 'asym'}")


@pytest.mark.parametrize("bits,group_size,symmetric", [(4, 32, False), (4, None, True), (8, None, True),
                                                       (8, 32, False)])
def test_matches_transformers_decompressed(tmp_path, bits, group_size, symmetric):
    path = write_checkpoint(tmp_path, bits, group_size, symmetric)
    ref = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    llm = LLM(str(path), num_kv_blocks=64)
    model = llm.engine.model
    layer = model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear.quant_method, GroupedLinearMethod)
        assert linear.quant_method.fmt.bits == bits
    assert_matches_reference(llm, ref, 2, (6, 19, 40), NEW_TOKENS, 1e-3)


def test_packed_weights_with_quantized_activations_are_refused(tmp_path):
    path = write_checkpoint(tmp_path, 8, None, True)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="format 'pack-quantized'.*W4A16 and W8A16"):
        LLM(str(path), num_kv_blocks=8)
