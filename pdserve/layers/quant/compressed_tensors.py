"""compressed-tensors checkpoints (llm-compressor's format, `quant_method: compressed-tensors`):
- weight-only int4 and int8 (W4A16, W8A16) in the `pack-quantized` format, per group or per
  channel, symmetric or asymmetric, kept quantized in pdserve's group format (grouped.py);
- FP8 (`float-quantized`: e4m3 weights per tensor, per channel or in 128x128 blocks) and W8A8
  int8 (`int-quantized`: per-channel int8 weights), with dynamic activation scales, kept 8-bit
  (act_quant.py).

A quantized Linear's checkpoint tensors: `weight_packed` (int32; q + 2^(bits-1) as unsigned
bits-wide fields, densely little-endian along the input dimension), `weight_scale` [out,
groups], `weight_zero_point` (asymmetric only: int32, packed the same way along the output
dimension) and `weight_shape`. The value is w = (q - zero_point) * scale, q signed. In the
group format:
- int4: q + 8 in 0..15 with min = -(8 + zero_point) * scale;
- int8: q itself with min = -zero_point * scale (none when symmetric).
(One float32 rounding away from compressed-tensors' own (q - zp) * scale.)

FP8 and W8A8 checkpoints hold `weight` (float8_e4m3fn or int8) and `weight_scale`.
Anything else (static activation scales, asymmetric activations, other bit widths) is refused
with the list of what loads.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pdserve.layers.quant.act_quant import Fp8LinearMethod, Int8LinearMethod, expand_scale, scale_bits
from pdserve.layers.quant.base import QuantConfig, QuantMethod
from pdserve.layers.quant.grouped import FUSED_PARTS, GroupedLinearMethod, GroupedWeight, GroupFormat
from pdserve.layers.quant.unquantized import UnquantizedLinearMethod

SUPPORTED = ("W4A16 and W8A16 (pack-quantized int4/int8 weights, per group or per channel), FP8 "
             "(float-quantized, per tensor, per channel or 128x128 blocks, dynamic activations) and W8A8 "
             "(int-quantized int8, per channel or per tensor, dynamic per-token activations)")
_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


class CompressedTensorsError(ValueError):
    pass


@dataclass(frozen=True)
class WeightScheme:
    bits: int
    group_size: int  # 0: one scale per output channel
    symmetric: bool
    targets: tuple[str, ...]


def _refuse(what: str) -> CompressedTensorsError:
    return CompressedTensorsError(f"compressed-tensors checkpoint: {what} is not supported; pdserve loads {SUPPORTED}")


@dataclass(frozen=True)
class ActivationScheme:
    """8-bit weights with dynamic 8-bit activations (act_quant.py)."""
    kind: str  # "float" (FP8 e4m3) or "int" (int8)
    block: tuple[int, int] | None  # weight block (rows, columns); None: per channel or per tensor
    targets: tuple[str, ...]


def _activation_scheme(name: str, group: dict, fmt: str | None) -> ActivationScheme:
    w, a = group.get("weights") or {}, group["input_activations"]
    kind = w.get("type")
    if group.get("output_activations"):
        raise _refuse(f"quantized output activations (scheme {name!r})")
    if kind not in ("float", "int") or w.get("num_bits") != 8 or a.get("num_bits") != 8 or a.get("type") != kind:
        raise _refuse(f"{w.get('num_bits')}-bit {kind} weights with {a.get('num_bits')}-bit {a.get('type')} "
                      f"activations (scheme {name!r})")
    if fmt not in (None, f"{kind}-quantized"):
        raise _refuse(f"format {fmt!r} of scheme {name!r}")
    if not a.get("dynamic"):
        raise _refuse(f"static activation scales (scheme {name!r}; dynamic ones load)")
    if not (w.get("symmetric", True) and a.get("symmetric", True)) or w.get("actorder"):
        raise _refuse(f"asymmetric or activation-ordered 8-bit quantization (scheme {name!r})")
    strategy, block = w.get("strategy"), None
    if strategy == "block" and kind == "float":
        block = tuple(int(b) for b in w.get("block_structure") or ())
        if len(block) != 2 or a.get("strategy") != "group" or a.get("group_size") != block[1]:
            raise _refuse(f"blocks {block} with {a.get('strategy')} activations of {a.get('group_size')} "
                          f"columns (scheme {name!r}; column blocks must match the activation groups)")
    elif strategy not in ("channel", "tensor") or a.get("strategy") != "token":
        raise _refuse(f"{strategy} {kind} weights with {a.get('strategy')} activations (scheme {name!r})")
    return ActivationScheme(kind, block, tuple(group.get("targets") or ()))


def _scheme(name: str, group: dict, default_format: str | None = None) -> WeightScheme | ActivationScheme:
    fmt = group.get("format") or default_format
    if group.get("input_activations"):
        return _activation_scheme(name, group, fmt)
    if group.get("output_activations"):
        raise _refuse(f"quantized output activations (scheme {name!r})")
    w = group.get("weights") or {}
    if fmt not in (None, "pack-quantized"):
        raise _refuse(f"format {fmt!r} of scheme {name!r}")
    if w.get("type") != "int" or w.get("num_bits") not in (4, 8):
        raise _refuse(f"{w.get('num_bits')}-bit {w.get('type')} weights (scheme {name!r})")
    if w.get("actorder") or w.get("dynamic"):
        raise _refuse(f"activation-ordered or dynamic weights (scheme {name!r})")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise _refuse(f"the {strategy!r} weight strategy (scheme {name!r})")
    group_size = int(w.get("group_size") or 0) if strategy == "group" else 0
    return WeightScheme(int(w["num_bits"]), group_size, bool(w.get("symmetric", True)),
                        tuple(group.get("targets") or ()))


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == "Linear" or name == pattern or name.endswith(f".{pattern}")


class CompressedTensorsConfig(QuantConfig):
    name = "compressed-tensors"

    def __init__(self, quantization_config: dict):
        qc = quantization_config
        if qc.get("format") not in (None, "pack-quantized", "mixed-precision", "float-quantized", "int-quantized"):
            raise _refuse(f"format {qc.get('format')!r}")
        if qc.get("sparsity_config"):
            raise _refuse("a sparsity config")
        if qc.get("kv_cache_scheme"):
            raise _refuse("a quantized KV cache scheme")
        fmt = qc.get("format") if qc.get("format") != "mixed-precision" else None
        self.schemes = [_scheme(n, g, fmt) for n, g in (qc.get("config_groups") or {}).items()]
        self.ignore = tuple(qc.get("ignore") or ())

    def scheme_for(self, module_name: str) -> WeightScheme | ActivationScheme | None:
        """The weight scheme of the checkpoint's module `module_name` (model.layers.0.mlp.up_proj)."""
        if any(_matches(p, module_name) for p in self.ignore if p != "Linear"):
            return None
        return next((s for s in self.schemes if any(_matches(t, module_name) for t in s.targets)), None)

    def linear_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        if prefix == "embed_tokens":
            return UnquantizedLinearMethod()
        head, _, last = prefix.rpartition(".")
        names = [f"model.{head}.{p}" for p in FUSED_PARTS[last]] if last in FUSED_PARTS else [
            prefix if prefix == "lm_head" else f"model.{prefix}"]
        schemes = {self.scheme_for(n) for n in names}
        if len(schemes) > 1:
            raise _refuse(f"parts of {prefix} quantized differently ({', '.join(names)})")
        scheme = schemes.pop()
        if scheme is None:
            return UnquantizedLinearMethod()
        if isinstance(scheme, ActivationScheme):
            if scheme.kind == "int":
                return Int8LinearMethod()
            return Fp8LinearMethod(scheme.block[1] if scheme.block else 0)
        group = scheme.group_size or layer.input_size
        return GroupedLinearMethod(GroupFormat(scheme.bits, group, half_scales=False,
                                               has_min=scheme.bits == 4 or not scheme.symmetric))


def _unpack(packed: torch.Tensor, bits: int, count: int) -> np.ndarray:
    """int32 [rows, words] of dense little-endian `bits` fields -> signed values [rows, count]."""
    raw = np.ascontiguousarray(packed.to(torch.int32).numpy()).view(np.uint8)
    fields = raw if bits == 8 else np.stack([raw & 15, raw >> 4], axis=-1).reshape(raw.shape[0], -1)
    return fields[:, :count].astype(np.int16) - (1 << (bits - 1))


def decode(parts: dict[str, torch.Tensor], scheme: WeightScheme) -> GroupedWeight:
    rows, cols = (int(v) for v in parts["weight_shape"].tolist())
    q = _unpack(parts["weight_packed"], scheme.bits, cols)[:rows]
    scales = parts["weight_scale"].float().reshape(rows, -1).numpy()
    group = cols // scales.shape[1]
    zero = parts.get("weight_zero_point")
    zp = (np.zeros_like(scales) if zero is None or scheme.symmetric
          else _unpack(zero.T, scheme.bits, rows).T.astype(np.float32))
    if scheme.bits == 4:
        return GroupedWeight((q + 8).astype(np.uint8), scales, -(8 + zp) * scales, group, 4)
    mins = None if scheme.symmetric else (-zp * scales).astype(np.float32)
    return GroupedWeight(q.astype(np.int8), scales, mins, group, 8)


def grouped_tensors(tensors: Iterable[tuple[str, torch.Tensor]],
                    config: CompressedTensorsConfig) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors, with each quantized Linear's parts gathered into one
    `<module>.weight` GroupedWeight (they may come in any order, across shards)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, part = name.rpartition(".")
        if _is_activation_part(part, tensor) and isinstance(scheme := config.scheme_for(module), ActivationScheme):
            parts = pending.setdefault(module, {})
            parts[part] = tensor
            if {"weight", "weight_scale"} <= parts.keys():
                yield from activation_tensors(module, pending.pop(module), scheme)
            continue
        if part not in _PARTS:
            yield name, tensor
            continue
        scheme = config.scheme_for(module)
        if scheme is None:
            raise CompressedTensorsError(f"{name}: a quantized tensor of a module no scheme targets")
        if part == "weight_zero_point" and scheme.symmetric:
            continue  # all zeros where a writer keeps it
        parts = pending.setdefault(module, {})
        parts[part] = tensor
        needed = {"weight_packed", "weight_scale", "weight_shape"} | (set() if scheme.symmetric
                                                                       else {"weight_zero_point"})
        if needed <= parts.keys():
            yield f"{module}.weight", decode(pending.pop(module), scheme)
    if pending:
        raise CompressedTensorsError(f"checkpoint is missing quantized parts of {', '.join(sorted(pending))}")


def _is_activation_part(part: str, tensor: torch.Tensor) -> bool:
    return part == "weight_scale" or (part == "weight" and tensor.dtype in (torch.float8_e4m3fn, torch.int8))


def activation_tensors(module: str, parts: dict[str, torch.Tensor],
                       scheme: ActivationScheme) -> Iterator[tuple[str, torch.Tensor]]:
    """An FP8 / W8A8 module's weight (its bytes) and its scale in act_quant's per-row layout."""
    weight = parts["weight"]
    want = torch.float8_e4m3fn if scheme.kind == "float" else torch.int8
    if weight.dtype != want:
        raise CompressedTensorsError(f"{module}.weight is {weight.dtype}; its scheme stores {want}")
    yield f"{module}.weight", weight.view(torch.uint8) if scheme.kind == "float" else weight
    rows = weight.shape[0]
    yield f"{module}.weight_scale", scale_bits(expand_scale(parts["weight_scale"], rows,
                                                            scheme.block[0] if scheme.block else 0))
