"""FP8 block checkpoints as DeepSeek-V3 ships them: `quantization_config: {quant_method: fp8,
fmt: e4m3, weight_block_size: [128, 128], activation_scheme: dynamic}`. Each quantized Linear
has `weight` (float8_e4m3fn [out, in]) and `weight_scale_inv` (float32 [ceil(out / 128),
ceil(in / 128)]: despite its name, w = weight * weight_scale_inv).

Qwen3's FP8 checkpoints use the same format. Kept FP8 in act_quant's layout (Fp8LinearMethod,
activations quantized per token in groups of 128 columns, as DeepSeek's own inference code and
vLLM do). A model decides which modules it keeps (the Llama family: every Linear the checkpoint
quantized, through Fp8BlockConfig; DeepSeek: see pdserve.models.deepseek); the others' weights
are dequantized to float32 at load (fp8_block_tensors), with one log line counting them.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pdserve.layers.linear import ReplicatedLinear
from pdserve.layers.quant.act_quant import Fp8LinearMethod, expand_scale, scale_bits
from pdserve.layers.quant.base import QuantConfig, QuantMethod
from pdserve.layers.quant.grouped import FUSED_PARTS
from pdserve.layers.quant.unquantized import UnquantizedLinearMethod

log = logging.getLogger("pdserve.quant")

SUPPORTED = ("quant_method fp8 with fmt e4m3, activation_scheme dynamic and a 2-d weight_block_size "
             "(DeepSeek-V3's FP8 checkpoints)")


def block_size(quantization: dict) -> tuple[int, int]:
    """The weight block of an FP8 block checkpoint's quantization_config; ValueError naming what
    is not supported."""
    block = quantization.get("weight_block_size")
    problems = []
    if quantization.get("quant_method") != "fp8":
        problems.append(f"quant_method {quantization.get('quant_method')!r}")
    if quantization.get("fmt", "e4m3") != "e4m3":
        problems.append(f"fmt {quantization.get('fmt')!r}")
    if quantization.get("activation_scheme", "dynamic") != "dynamic":
        problems.append(f"activation_scheme {quantization.get('activation_scheme')!r}")
    if not block or len(block) != 2:
        problems.append(f"weight_block_size {block!r} (per-tensor FP8)")
    if problems:
        raise ValueError(f"FP8 checkpoint with {', '.join(problems)} is not supported; pdserve loads {SUPPORTED}")
    return int(block[0]), int(block[1])


def fp8_modules(files: list[Path]) -> set[str]:
    """The checkpoint's modules (names without 'model.') that carry a weight_scale_inv."""
    names = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(n.removeprefix("model.").removesuffix(".weight_scale_inv") for n in f.keys()
                         if n.endswith(".weight_scale_inv"))
    return names


class Fp8BlockConfig(QuantConfig):
    """Each linear layer whose checkpoint parts (q, k, v; gate, up; or the one) are FP8 keeps
    them FP8; a layer the checkpoint left in float stays float."""
    name = "fp8"

    def __init__(self, quantization: dict, quantized: set[str]):
        self.block = block_size(quantization)
        self.quantized = quantized

    def linear_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        head, _, last = prefix.rpartition(".")
        parts = [f"{head}.{p}" for p in FUSED_PARTS[last]] if last in FUSED_PARTS else [prefix]
        kept = {p in self.quantized for p in parts}
        if len(kept) > 1:
            raise ValueError(f"FP8 checkpoint: parts of {prefix} are quantized differently ({', '.join(parts)})")
        if prefix == "embed_tokens" or not kept.pop():
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(self.block[1])


def fp8_linear(linear: nn.Linear, block: tuple[int, int], prefix: str) -> nn.Module:
    """A ReplicatedLinear holding FP8 weights in place of `linear` (built on the same device)."""
    class _Fp8(QuantConfig):
        name = "fp8"

        def linear_method(self, layer, prefix):
            return Fp8LinearMethod(block[1])

    return ReplicatedLinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                            quant_config=_Fp8(), prefix=prefix)


def fp8_block_tensors(tensors: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int],
                      keeps: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each FP8 matrix and its weight_scale_inv paired up: as
    `<module>.weight` (its bytes, uint8) and `<module>.weight_scale` (act_quant's per-row layout)
    where keeps(module), else as one float32 `<module>.weight`."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    dequantized = 0
    for name, tensor in tensors:
        module, _, part = name.rpartition(".")
        if not (part == "weight_scale_inv" or (part == "weight" and tensor.dtype == torch.float8_e4m3fn)):
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[part] = tensor
        if len(parts) < 2:
            continue
        del pending[module]
        weight, scale = parts["weight"], expand_scale(parts["weight_scale_inv"], parts["weight"].shape[0], block[0])
        if keeps(module):
            yield f"{module}.weight", weight.view(torch.uint8)
            yield f"{module}.weight_scale", scale_bits(scale)
        else:
            dequantized += 1
            yield f"{module}.weight", weight.float() * scale.repeat_interleave(block[1], 1)[:, :weight.shape[1]]
    if pending:
        raise ValueError(f"FP8 checkpoint: weights without a weight_scale_inv, or the reverse: "
                         f"{', '.join(sorted(pending)[:8])}")
    if dequantized:
        log.warning("FP8 checkpoint: %d matrices that pdserve multiplies in float (MLA's kv_b_proj) were "
                    "dequantized to float at load", dequantized)
