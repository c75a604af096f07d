"""The quantized checkpoints gpu_quant measures, written from one full-precision checkpoint:
FP8 per channel (compressed-tensors FP8_DYNAMIC), FP8 in 128x128 blocks (quant_method fp8, as
DeepSeek-V3 and Qwen3-FP8 ship), and W4A16 (compressed-tensors pack-quantized int4, symmetric,
groups of 128). Each is written once under its directory and reused by later runs."""
from __future__ import annotations

import json
from pathlib import Path

import torch

FORMATS = ("bf16", "fp8-channel", "fp8-block", "w4a16")
W4A16_GROUP = 128


def write_w4a16(src: Path, out: Path, group: int = W4A16_GROUP) -> Path:
    """Round-to-nearest int4 with scales from each group's range (weight-only: no data needed)."""
    # optional dependency: compressed-tensors (the pdserve[test] extra)
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    from pdserve.testing.model_factory import save_compressed
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.data
            groups = w.reshape(w.shape[0], -1, group)
            scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    return save_compressed(model, compressor, src, out)


def w4a16_group(src: Path) -> int:
    """Groups of 128 columns, or 32 where a layer's input (hidden or intermediate size) is not a
    multiple of 128 (the tests' small models)."""
    config = json.loads((src / "config.json").read_text())
    inputs = (config["hidden_size"], config["intermediate_size"])
    return W4A16_GROUP if all(k % W4A16_GROUP == 0 for k in inputs) else 32


def checkpoint(src: Path, fmt: str) -> Path:
    """The checkpoint of src in fmt (bf16: src itself), written on first use beside src."""
    from pdserve.testing import quant_checkpoints
    root = src.parent / f"{src.name}-quant"
    root.mkdir(exist_ok=True)
    if fmt == "bf16":
        return src
    if fmt == "fp8-channel":
        out = root / "FP8_DYNAMIC"
        return out if out.exists() else quant_checkpoints.write_act_quant(root, src, "FP8_DYNAMIC")
    if fmt == "fp8-block":
        out = root / "fp8"
        return out if out.exists() else quant_checkpoints.write_fp8(src, root)[0]
    if fmt == "w4a16":
        out = root / "w4a16"
        return out if out.exists() else write_w4a16(src, out, w4a16_group(src))
    raise ValueError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")
