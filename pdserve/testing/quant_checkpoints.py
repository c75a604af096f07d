"""Quantized checkpoints written from a float32 one, for tests and benchmarks: compressed-tensors
checkpoints that quantize activations (FP8 per channel or in 128x128 blocks, W8A8 int8), FP8
block checkpoints as DeepSeek-V3 and Qwen3 ship them (quant_method fp8, weight_scale_inv), and
gpt-oss's MXFP4 experts (quant_method mxfp4)."""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pdserve.testing.model_factory import save_compressed

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
PRESETS = {"FP8_DYNAMIC": "float-quantized", "FP8_BLOCK": "float-quantized", "W8A8": "int-quantized"}
BLOCK = 128


def _weight_qparams(weight: torch.Tensor, args) -> torch.Tensor:
    """Round-to-nearest scales from the weight's range, per channel or per block."""
    # optional dependency: compressed-tensors (the pdserve[test] extra)
    from compressed_tensors.quantization.utils import calculate_qparams
    if args.strategy == "block":
        rows, cols = weight.shape
        br, bc = args.block_structure
        pad = torch.nn.functional.pad(weight, (0, -cols % bc, 0, -rows % br))
        blocks = pad.view(pad.shape[0] // br, br, pad.shape[1] // bc, bc)
        low, high = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    else:
        low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    return calculate_qparams(low, high, args)[0]


def write_act_quant(root, src, preset: str):
    """A compressed-tensors checkpoint of src under root/PRESET: weights quantized round-to-nearest
    with scales from their range, activations quantized per token at run time."""
    # optional dependency: compressed-tensors (the pdserve[test] extra)
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (  # optional dependency: compressed-tensors, as above
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from transformers import AutoModelForCausalLM  # deferred: transformers takes ~1 s to import
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            module.weight_scale.data.copy_(_weight_qparams(module.weight.data, scheme.weights))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=PRESETS[preset])
    compressor.compress_model(model)
    return save_compressed(model, compressor, src, root / preset)


def _quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    pad = F.pad(w, (0, -cols % BLOCK, 0, -rows % BLOCK))
    blocks = pad.view(pad.shape[0] // BLOCK, BLOCK, pad.shape[1] // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(pad.shape)[:rows, :cols].contiguous(), scale


def _dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return q.float() * full[:q.shape[0], :q.shape[1]]


def is_block_quantized(name: str, tensor: torch.Tensor) -> bool:
    return (name.endswith(".weight") and tensor.dim() == 2 and "norm" not in name
            and not name.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")))


def write_fp8(src, root):
    """(the FP8 checkpoint, a float32 checkpoint of its dequantized weights)."""
    fp8, dequantized = root / "fp8", root / "dequantized"
    tensors = load_file(str(src / "model.safetensors"))
    out_fp8, out_deq = {}, {}
    for name, t in tensors.items():
        if is_block_quantized(name, t):
            q, scale = _quantize_blocks(t)
            out_fp8[name], out_fp8[name.replace(".weight", ".weight_scale_inv")] = q, scale
            out_deq[name] = _dequantize_blocks(q, scale)
        else:
            out_fp8[name] = out_deq[name] = t
    config = json.loads((src / "config.json").read_text())
    for path, out in ((fp8, out_fp8), (dequantized, out_deq)):
        path.mkdir()
        save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
        for f in src.iterdir():
            if f.name != "model.safetensors":
                (path / f.name).write_bytes(f.read_bytes())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, dequantized


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A gpt-oss expert tensor in the unquantized layout [E, cols, rows] -> (blocks, scales):
    two e2m1 codes a byte (the low nibble first) and a power of two per 32 columns, rounded to
    the nearest code."""
    rows_first = w.transpose(1, 2)  # [E, rows, cols]
    groups = rows_first.reshape(*rows_first.shape[:2], -1, 32)
    exp = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -100))) - 2  # 6 = 1.5 * 2^2
    scaled = groups / torch.exp2(exp).unsqueeze(-1)  # exact: exp is a whole number
    index = (scaled.abs().unsqueeze(-1) - FP4).abs().argmin(-1) + 8 * (scaled < 0)
    codes = index.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def write_mxfp4(src):
    """Rewrite the float gpt-oss checkpoint at src (one safetensors file) with MXFP4 experts, as
    gpt-oss ships them: `*_blocks` and `*_scales`, everything else left float."""
    tensors = load_file(str(src / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = to_mxfp4(tensors.pop(name))
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (src / "config.json").write_text(json.dumps(config))
    return src
