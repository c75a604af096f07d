"""GPTQ and AWQ checkpoints (`quant_method: gptq` / `awq`), kept quantized in pdserve's group
format (grouped.py).

Both store, for each quantized Linear with W [out, in], unsigned `bits`-wide fields packed
little-endian into int32 words, `scales` float16 [groups, out], and w = (q - zero) * scale:
- GPTQ (GPTQModel / AutoGPTQ / optimum): `qweight` int32 [in * bits / 32, out], packed along the
  input dimension; `qzeros` int32 [groups, out * bits / 32], packed along the output dimension;
  `g_idx` int32 [in], the group of each input column. The v1 format (`checkpoint_format: gptq`,
  the default) stores zero - 1 in each field, and readers add 1 back per field, as vLLM's and
  the exllama kernels do; `gptq_v2` stores the zero itself. With `desc_act` (activation order)
  g_idx is a shuffled assignment: the layer then holds its columns sorted by group and takes its
  input in that order (PermutedGroupedMethod), which is exact.
- AWQ GEMM (AutoAWQ): `qweight` int32 [in, out / 8] and `qzeros` int32 [groups, out / 8], both
  packed along the output dimension with eight columns to a word in the order
  [0, 2, 4, 6, 1, 3, 5, 7] (field i holds column ORDER[i]); the zero is stored as is.

In the group format (scales and mins kept float32: (q - zero) * scale of a float16 scale and an
integer of at most 9 bits is exact in float32, so the layer holds exactly the checkpoint's values):
- 4 bits: q itself (0..15) with min = -zero * scale;
- 8 bits: q - 128 (int8) with min = (128 - zero) * scale; none when symmetric (zero 128).
Anything else is refused with the list of what loads.
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import quant_cpu
from pdserve.layers.quant import cuda_kernels
from pdserve.layers.quant.base import QuantConfig, QuantMethod
from pdserve.layers.quant.grouped import FUSED_PARTS, GroupedLinearMethod, GroupedWeight, GroupFormat
from pdserve.layers.quant.unquantized import UnquantizedLinearMethod

METHODS = ("gptq", "awq")
SUPPORTED = ("GPTQ (4 or 8 bits; groups of 16 or a multiple of 32 columns, or per channel (group_size -1); "
             "desc_act with g_idx; sym true or false; checkpoint_format gptq (v1) or gptq_v2; int32 packing) "
             "and AWQ (version gemm, 4 bits, zero_point true, groups of 16 or a multiple of 32 columns)")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_REVERSE = tuple(AWQ_ORDER.index(c) for c in range(8))  # natural column c sits in field _AWQ_REVERSE[c]
_PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales")}


class GptqAwqError(ValueError):
    pass


def _refuse(method: str, what: str) -> GptqAwqError:
    return GptqAwqError(f"{method} checkpoint: {what} is not supported; pdserve loads {SUPPORTED}")


@dataclass(frozen=True)
class Scheme:
    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # 0: one group per output channel
    sym: bool
    desc_act: bool
    zero_offset: int  # added to each stored zero: 1 for GPTQ v1


def _group_size(method: str, value) -> int:
    group = int(value if value is not None else 128)
    if group == -1 and method == "gptq":
        return 0
    if group <= 0 or not (group == 16 or group % 32 == 0):
        raise _refuse(method, f"group_size {group}")
    return group


def parse_scheme(qc: dict) -> Scheme:
    method = qc.get("quant_method")
    if method == "gptq":
        return _gptq_scheme(qc)
    if method == "awq":
        return _awq_scheme(qc)
    raise GptqAwqError(f"quant_method {method!r} is neither gptq nor awq")


def _gptq_scheme(qc: dict) -> Scheme:
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if qc.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", f"checkpoint_format {'marlin' if qc.get('is_marlin_format') else fmt!r}")
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise _refuse("gptq", f"{bits}-bit weights")
    if str(qc.get("pack_dtype") or "int32").removeprefix("torch.") != "int32":
        raise _refuse("gptq", f"pack_dtype {qc.get('pack_dtype')!r}")
    if qc.get("dynamic"):
        raise _refuse("gptq", "per-module overrides (dynamic)")
    if qc.get("lm_head"):
        raise _refuse("gptq", "a quantized lm_head")
    return Scheme("gptq", bits, _group_size("gptq", qc.get("group_size")), bool(qc.get("sym", True)),
                  bool(qc.get("desc_act", False)), 1 if fmt == "gptq" else 0)


def _awq_scheme(qc: dict) -> Scheme:
    version = str(qc.get("version") or "gemm").lower()
    if version != "gemm" or str(qc.get("backend") or "autoawq").lower() != "autoawq":
        raise _refuse("awq", f"version {version!r} (backend {qc.get('backend') or 'autoawq'!r})")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse("awq", f"{bits}-bit weights")
    if not qc.get("zero_point", True):
        raise _refuse("awq", "zero_point false")
    group = _group_size("awq", qc.get("group_size", qc.get("q_group_size")))
    return Scheme("awq", 4, group, False, False, 0)


class PermutedGroupedMethod(GroupedLinearMethod):
    """A desc_act layer: its columns sorted by group (so each group is contiguous, as the kernels
    need), and `perm` [full input], the input column each sorted column came from.

    A row-parallel layer at TP > 1 holds its rank's share of the sorted columns (whole groups),
    whose inputs lie anywhere in the full input, across every rank's shard: it gathers the whole
    input first (one all-gather), takes its columns, and its partial product joins the layer's
    all-reduce as any other's. (vLLM keeps act-order shards in checkpoint order with a g_idx
    lookup in its kernels instead; ours need contiguous groups.)"""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        super().create_weights(layer, input_size, output_sizes, dtype)
        full = layer.full_input_size
        layer.register_parameter("perm", nn.Parameter(torch.zeros(full, dtype=torch.int64), requires_grad=False))
        layer.param_dims["perm"] = (None, None)

    @staticmethod
    def _split(layer: nn.Module) -> bool:
        return getattr(layer, "split_input", False) and layer.tp.size > 1

    def _inputs(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """[tokens, input_size]: the input columns of this rank's sorted columns, in their order."""
        if not self._split(layer):
            return x.reshape(-1, x.shape[-1]).index_select(1, layer.perm)
        whole = layer.tp.all_gather_last(x.reshape(-1, x.shape[-1]))
        start = layer.tp.rank * layer.input_size
        return whole.index_select(1, layer.perm[start:start + layer.input_size])

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = self._inputs(layer, x)
        if cuda_kernels.runs_triton(x):
            y = cuda_kernels.grouped_apply(layer, self._parts(layer), self.fmt.bits, self.fmt.group, flat, bias)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        y = quant_cpu.packed_matmul(flat, super().packed(layer))
        if y.dtype != x.dtype or x.dim() != 2:
            y = y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
        return y + bias if bias is not None else y

    def packed(self, layer: nn.Module) -> quant_cpu.PackedMatrix:
        """The matrix for callers that multiply by it themselves (the compiled decode step,
        pdserve.kernels.native_decode), without the compiled gemv's arguments: they would skip
        the input permutation, so such a model decodes layer by layer through apply."""
        return dataclasses.replace(super().packed(layer), native=None)

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        """In checkpoint column order (a layer that holds its whole input: a rank's share of a
        split one has no such order)."""
        if self._split(layer):
            raise NotImplementedError("a desc_act shard of a split input has no checkpoint column order")
        sorted_cols = super().dequantized(layer)
        out = torch.empty_like(sorted_cols)
        out[:, layer.perm] = sorted_cols
        return out


@dataclass
class PermutedGroupedWeight(GroupedWeight):
    perm: np.ndarray | None = None  # int64 [cols]: the checkpoint column of each (sorted) column

    def to_params(self, fmt: GroupFormat) -> dict[str, torch.Tensor]:
        return {**super().to_params(fmt), "perm": torch.from_numpy(self.perm.astype(np.int64))}


class GptqAwqConfig(QuantConfig):
    def __init__(self, quantization_config: dict):
        qc = quantization_config
        self.scheme = parse_scheme(qc)
        self.name = self.scheme.method
        self.not_converted = tuple(qc.get("modules_to_not_convert") or ())
        blocks = qc.get("modules_in_block_to_quantize")
        self.block_modules = tuple(m for block in blocks for m in block) if blocks else None
        self.layers: dict[str, nn.Module] = {}  # pdserve prefix -> layer, to tell which take a bias
        self.tied: dict = {}  # the embedding's and the LM head's ExactFloatMethod share what they hold

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint's module `module` (model.layers.0.mlp.up_proj) is quantized."""
        if not module.startswith("model.layers.") or any(m in module for m in self.not_converted):
            return False
        return self.block_modules is None or any(module.endswith(f".{m}") for m in self.block_modules)

    def linear_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        if prefix in ("embed_tokens", "lm_head"):
            return ExactFloatMethod(self.tied)
        head, _, last = prefix.rpartition(".")
        names = [f"model.{head}.{p}" for p in FUSED_PARTS.get(last, (last,))]
        quantized = {self.quantizes(n) for n in names}
        if len(quantized) > 1:
            raise _refuse(self.name, f"parts of {prefix} quantized differently ({', '.join(names)})")
        self.layers[prefix] = layer
        if not quantized.pop():
            return UnquantizedLinearMethod()
        s = self.scheme
        # gcd: groups of the whole input when per channel (0), split where the columns are not whole groups
        fmt = GroupFormat(s.bits, math.gcd(s.group_size, layer.input_size), half_scales=False,
                          has_min=s.bits == 4 or not s.sym)
        return PermutedGroupedMethod(fmt) if s.desc_act else GroupedLinearMethod(fmt)


# GGUF's Q8_0: int8 values, one float16 scale per 32 columns (held as int16 bits, as grouped.py holds them), no min
Q8_FORMAT = GroupFormat(8, 32, half_scales=True, has_min=False)
# exact_int8_groups checks this many values at a time: a few MB of temporaries, and a float matrix
# that does not fit (most: trained embeddings) is usually told apart in the first chunk
_VALUES_PER_CHECK = 1 << 20


def exact_int8_groups(w: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """w [rows, cols] float32 as int8 q [rows, cols] and float16 scales [rows, cols // 32] with
    q * scale == w for every value in float32 (GGUF's Q8_0 form), or None where some group of 32
    has no such scale. The scale tried is max |w| / 127, as Q8_0 makes it; a float32 matrix
    dequantized from Q8_0 (a GGUF's embedding written out by transformers) always fits."""
    rows, cols = w.shape
    if cols % 32 or w.dtype != np.float32:
        return None
    q, scales = np.empty((rows, cols), dtype=np.int8), np.empty((rows, cols // 32), dtype=np.float16)
    step = max(1, _VALUES_PER_CHECK // cols)
    for start in range(0, rows, step):
        g = w[start:start + step].reshape(-1, cols // 32, 32)
        s16 = (np.abs(g).max(axis=2) / np.float32(127)).astype(np.float16)
        s = s16.astype(np.float32)[..., None]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            qs = np.where(s == 0, np.float32(0), np.rint(g / s))
        if not (np.abs(qs) <= 127).all() or not np.array_equal(qs * s, g):
            return None  # (also a NaN or an infinity: never equal)
        q[start:start + g.shape[0]] = qs.reshape(g.shape[0], cols)
        scales[start:start + g.shape[0]] = s16
    return q, scales


class ExactFloatMethod(QuantMethod):
    """The embedding and the LM head, float in GPTQ and AWQ checkpoints. Loaded as float, then held
    as Q8_0 groups where those hold every value exactly (exact_int8_groups), and multiplied by the
    grouped kernels: SmolLM2's tied LM head, read whole each decode step, is 30 MB instead of
    113 MB, the same bytes and kernel as the GGUF's, and the same float32 values. Otherwise it
    stays float, multiplied as UnquantizedLinearMethod does."""

    def __init__(self, tied: dict):
        self.tied = tied  # shared with the other vocabulary layer's method, so a tied pair converts once
        self.grouped: GroupedLinearMethod | None = None

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        UnquantizedLinearMethod().create_weights(layer, input_size, output_sizes, dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        # Weak references, so that what the first layer let go (its float matrix) is not kept here
        source = self.tied.get("source", lambda: None)()
        params = {name: ref() for name, ref in self.tied.get("params", {}).items()}
        if source is not weight or None in params.values():  # not the LM head tied to a converted embedding
            found = exact_int8_groups(weight.detach().numpy()) if weight.dtype == torch.float32 else None
            if found is None:
                return
            params = {"qweight": nn.Parameter(torch.from_numpy(found[0]), requires_grad=False),
                      "scales": nn.Parameter(torch.from_numpy(found[1].view(np.int16)), requires_grad=False)}
            self.tied.update(source=weakref.ref(weight), params={n: weakref.ref(p) for n, p in params.items()})
        del layer.weight
        for name, param in params.items():
            layer.register_parameter(name, param)
            layer.param_dims[name] = (0, 1)
        self.grouped = GroupedLinearMethod(Q8_FORMAT)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.grouped is not None:
            return self.grouped.apply(layer, x, bias)
        return F.linear(x, layer.weight, bias)

    def embedding(self, layer: nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
        if self.grouped is not None:
            return self.grouped.embedding(layer, token_ids)
        return F.embedding(token_ids, layer.weight)


def _fields(packed: torch.Tensor, bits: int, axis: int) -> np.ndarray:
    """int32 words -> their unsigned `bits`-wide fields, little-endian, laid out along `axis`
    (0: each word holds 32 / bits consecutive rows; 1: consecutive columns)."""
    words = np.ascontiguousarray(packed.to(torch.int32).numpy()).view(np.uint32)
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    mask = np.uint32((1 << bits) - 1)
    if axis == 0:
        return ((words[:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, words.shape[1])
    return ((words[:, :, None] >> shifts[None, None, :]) & mask).reshape(words.shape[0], -1)


def _grouped(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, scheme: Scheme,
              group: int, module: str) -> GroupedWeight:
    """q [out, in] 0..2^bits-1, zeros and scales [out, groups] -> the group format's weight.
    Where the columns are not a whole number of groups (SmolLM2's 576 in groups of 128: the last
    has 64), the groups are split into groups of gcd(group, columns), each with its group's scale."""
    cols = q.shape[1]
    if cols % group:
        sub = math.gcd(group, cols)
        zeros, scales = (np.repeat(a, group // sub, axis=1)[:, :cols // sub] for a in (zeros, scales))
        group = sub
    if scheme.bits == 4:
        return GroupedWeight(q.astype(np.uint8), scales, -zeros * scales, group, 4)
    if scheme.sym and (zeros != 128).any():
        raise GptqAwqError(f"{module}: a symmetric 8-bit checkpoint with zero points other than 128")
    mins = None if scheme.sym else (128 - zeros) * scales
    return GroupedWeight((q.astype(np.int16) - 128).astype(np.int8), scales, mins, group, 8)


def decode_gptq(parts: dict[str, torch.Tensor], scheme: Scheme, module: str) -> GroupedWeight:
    q = _fields(parts["qweight"], scheme.bits, axis=0)  # [in, out]
    scales = parts["scales"].float().numpy()  # [groups, out]
    cols, rows = q.shape[0], scales.shape[1]
    zeros = _fields(parts["qzeros"], scheme.bits, axis=1)[:, :rows].astype(np.float32) + scheme.zero_offset
    group = scheme.group_size or cols
    g_idx = parts["g_idx"].to(torch.int64).numpy() if "g_idx" in parts else np.arange(cols) // group
    perm = np.argsort(g_idx, kind="stable")
    if not np.array_equal(g_idx[perm], np.arange(cols) // group):
        raise GptqAwqError(f"{module}.g_idx does not give every group {group} columns")
    if not scheme.desc_act and not np.array_equal(perm, np.arange(cols)):
        raise GptqAwqError(f"{module}.g_idx is in activation order, but the config says desc_act false")
    weight = _grouped(q[perm].T, zeros.T, scales.T, scheme, group, module)
    if scheme.desc_act:
        return PermutedGroupedWeight(weight.q, weight.scales, weight.mins, weight.group, weight.bits, perm)
    return weight


def decode_awq(parts: dict[str, torch.Tensor], scheme: Scheme, module: str) -> GroupedWeight:
    def natural(packed: torch.Tensor) -> np.ndarray:  # [n, out / 8] words -> [n, out] in column order
        fields = _fields(packed, 4, axis=1)
        return fields.reshape(fields.shape[0], -1, 8)[:, :, _AWQ_REVERSE].reshape(fields.shape[0], -1)
    q = natural(parts["qweight"])  # [in, out]
    scales = parts["scales"].float().numpy()  # [groups, out]
    zeros = natural(parts["qzeros"])[:, :scales.shape[1]].astype(np.float32)
    if scales.shape[0] != -(-q.shape[0] // scheme.group_size):
        raise GptqAwqError(f"{module}: {scales.shape[0]} groups of {q.shape[0]} columns; the config says "
                           f"groups of {scheme.group_size}")
    return _grouped(q.T, zeros.T, scales.T, scheme, scheme.group_size, module)


def gptq_awq_tensors(tensors: Iterable[tuple[str, torch.Tensor]],
                     config: GptqAwqConfig) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors, with each quantized Linear's parts gathered into one
    `<module>.weight` GroupedWeight (they may come in any order, across shards)."""
    scheme, needed = config.scheme, set(_PARTS[config.scheme.method])
    decode = decode_gptq if scheme.method == "gptq" else decode_awq
    pending: dict[str, dict[str, torch.Tensor]] = {}
    perms: dict[str, np.ndarray] = {}
    for name, tensor in tensors:
        module, _, part = name.rpartition(".")
        if part == "bias" and config.quantizes(module) and _extra_bias(config, module, tensor):
            continue
        if part not in _PARTS[scheme.method] or not config.quantizes(module):
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[part] = tensor
        if needed <= parts.keys():
            weight = decode(pending.pop(module), scheme, module)
            _check_fused_order(perms, module, weight)
            yield f"{module}.weight", weight
    for module in [m for m, parts in pending.items() if needed - {"g_idx"} <= parts.keys()]:
        if scheme.desc_act:  # without g_idx, activation order is lost
            raise GptqAwqError(f"{module}.g_idx is missing from a desc_act checkpoint")
        yield f"{module}.weight", decode(pending.pop(module), scheme, module)
    if pending:
        raise GptqAwqError(f"checkpoint is missing quantized parts of {', '.join(sorted(pending))}")


def _layer_prefix(module: str) -> str:
    """pdserve's layer prefix of a checkpoint module (model.layers.0.self_attn.k_proj -> layers.0.self_attn.qkv_proj)."""
    head, _, last = module.removeprefix("model.").rpartition(".")
    fused = next((f for f, parts in FUSED_PARTS.items() if last in parts), last)
    return f"{head}.{fused}"


def _extra_bias(config: GptqAwqConfig, module: str, tensor: torch.Tensor) -> bool:
    """A zero bias of a layer that has none: some GPTQ writers give every quantized Linear one."""
    layer = config.layers.get(_layer_prefix(module))
    return layer is not None and layer.bias is None and not tensor.any()


def _check_fused_order(perms: dict[str, np.ndarray], module: str, weight: GroupedWeight) -> None:
    """The parts of a fused layer (q, k, v; gate, up) share its input, so they must share its order."""
    perm = getattr(weight, "perm", None)
    if perm is None:
        return
    prefix = _layer_prefix(module)
    if prefix in perms and not np.array_equal(perms[prefix], perm):
        raise GptqAwqError(f"{module}: its g_idx orders the input differently from the other parts of {prefix}")
    perms.setdefault(prefix, perm)
