"""Full-precision weights: one [out, in] matrix per rank, multiplied with F.linear.

Under cpu_gemm_dtype bfloat16 (pdserve.kernels.dequant_tiles) a float32 CPU matrix's products
of more than BF16_MIN_ROWS rows (prefill, large batches) run in bf16, on a bf16 copy of the
weights kept beside them (exact for a bf16 checkpoint served in float32; a float32 checkpoint's
weights round to 8 significant bits): on a CPU with AMX through the compiled gemv's tiles, from
a copy laid out as its B tiles (native_matrices.bf16_tiles: 1.3-3x oneDNN's F.linear with its
conversions, 16-512 rows of SmolLM2's shapes), elsewhere through oneDNN. Fewer rows stay float32:
decode steps are memory-bound, and the compiled step reads the float32 rows themselves. A bf16 checkpoint served in float32 has
exactly-bf16 weights: those few-row products (the compiled step's, the LM head's, the Python
layers') read bf16 rows instead, half the bytes, widened exactly (exact_bf16_weight)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.dequant_tiles import silu_mul_bf16, tile_dtype
from pdserve.kernels.native_matrices import bf16_rows_matmul, bf16_tiles
from pdserve.layers.quant.base import QuantConfig, QuantMethod

BF16_MIN_ROWS = 16  # as quant_cpu.QUANT_GEMV_MAX_TOKENS: more rows are a prefill's, compute-bound
# past this the tiles' pass over every token per 32 weight rows leaves L2, and oneDNN's blocking
# was level or ahead (2048 rows); up to it the tiles ran 1.3-3x F.linear (SmolLM2's shapes)
BF16_TILES_MAX_ROWS = 512


class UnquantizedLinearMethod(QuantMethod):
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype), requires_grad=False)
        layer.register_parameter("weight", weight)
        layer.param_dims["weight"] = (0, 1)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = bf16_rows_linear(layer, x)
        if y is not None:
            return y + bias if bias is not None else y
        if (tile_dtype() == torch.bfloat16 and x.dtype == torch.float32 and x.device.type == "cpu"
                and x.numel() > BF16_MIN_ROWS * x.shape[-1]):
            y = F.linear(x.to(torch.bfloat16), _bf16_weight(layer)).to(x.dtype)
            return y + bias if bias is not None else y
        return F.linear(x, layer.weight, bias)


def bf16_pass_takes(layer: nn.Module, rows: int) -> bool:
    """Whether the layer's product of `rows` rows is one bf16 pass through oneDNN (apply's path past
    the tiles' rows, or on a CPU without AMX): bf16 products, a float32 CPU weight."""
    w = layer.weight
    return (tile_dtype() == torch.bfloat16 and w.dtype == torch.float32 and w.device.type == "cpu"
            and rows > BF16_MIN_ROWS and (rows > BF16_TILES_MAX_ROWS or bf16_tiles_of(layer) is None))


def bf16_product(layer: nn.Module, x: torch.Tensor, keep_bf16: bool) -> torch.Tensor:
    """apply's oneDNN pass (bf16_pass_takes) for x float32 or already bf16: the bf16 result as it
    is where keep_bf16 (layers/bf16_rows.py), else widened, as apply returns it."""
    y = F.linear(x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16), _bf16_weight(layer))
    return y if keep_bf16 else y.float()


def exact_bf16_weight(layer: nn.Module) -> torch.Tensor | None:
    """The layer's float32 CPU weight as bf16 where that loses nothing (a bf16 checkpoint served in
    float32), else None: the compiled decode step reads these rows, half the bytes of the float32
    ones, and widens them exactly (native_gemv.c's bits 16). Checked once per weight storage."""
    w = layer.weight
    if w.dtype != torch.float32 or w.device.type != "cpu":
        return None
    exact = layer.__dict__.get("_bf16_exact")
    if exact is None or exact[0] != w.data_ptr():
        rows = w.detach().to(torch.bfloat16)
        exact = layer.__dict__["_bf16_exact"] = (w.data_ptr(), torch.equal(rows.float(), w))
        if exact[1]:  # (a float32 checkpoint's copy is not kept: prefill's bf16 products make their own)
            layer.__dict__["_bf16_weight"] = (w.data_ptr(), rows)
    return _bf16_weight(layer) if exact[1] else None


def bf16_rows_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """x @ weight.T through the compiled gemv: for a decode step's few rows on the weight's exact
    bf16 rows (float32 sums; memory-bound: half the bytes of F.linear's float32 rows), for more
    on AMX's tiles from bf16_tiles; None where neither applies or the gemv does not take them."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    if x.shape[0] <= BF16_MIN_ROWS:
        rows = exact_bf16_weight(layer)
        return bf16_rows_matmul(x, rows, bf16_tiles_of(layer)) if rows is not None else None
    tiles = bf16_tiles_of(layer) if x.shape[0] <= BF16_TILES_MAX_ROWS else None
    return bf16_rows_matmul(x, _bf16_weight(layer), tiles) if tiles is not None else None


def bf16_head_logits(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """An unquantized LM head's logits where bf16_rows_linear declines under bf16 products (more
    rows than a decode step's few, and no AMX tiles or more rows than theirs): float32 sums of bf16
    products in the compiled gemv (AVX-512 BF16 or AMX), as AMX's tiles give. The float32 product they replace read the float32
    weight (113 MB for SmolLM2) and MKL repacked it every call: 27% of a 32-request decode step
    of SmolLM2's bf16 checkpoint on a Zen 5 VM."""
    if (tile_dtype() != torch.bfloat16 or x.dim() != 2 or x.shape[0] <= BF16_MIN_ROWS
            or layer.weight.dtype != torch.float32 or layer.weight.device.type != "cpu"):
        return None
    return bf16_rows_matmul(x, _bf16_weight(layer))


def unquantized_head_logits(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An unquantized LM head's logits (no bias), for every family's head: a bf16 checkpoint's
    exact bf16 rows at a decode step's few rows (half the bytes) or AMX's tiles, float32 sums of
    bf16 products past them under cpu_gemm_dtype bfloat16 (bf16_head_logits), else the float32
    product. Never oneDNN's one bf16 pass, whose sums come back rounded to bf16: a step of 2^-8
    in every logit, enough to turn a greedy near tie."""
    logits = bf16_rows_linear(layer, x)
    logits = bf16_head_logits(layer, x) if logits is None else logits
    return F.linear(x, layer.weight) if logits is None else logits


def bf16_tiles_of(layer: nn.Module) -> torch.Tensor | None:
    """The layer's bf16 weight laid out as AMX's B tiles (native_matrices.bf16_tiles), made on first
    use and again when the weight's storage changes; None but under bf16 products on a CPU with AMX
    (the copy is kept only where its products run)."""
    w = layer.weight
    if tile_dtype() != torch.bfloat16 or w.dtype != torch.float32 or w.device.type != "cpu":
        return None
    cached = layer.__dict__.get("_bf16_tiles")
    if cached is None or cached[0] != w.data_ptr():
        cached = layer.__dict__["_bf16_tiles"] = (w.data_ptr(), bf16_tiles(_bf16_weight(layer)))
    return cached[1]


def _bf16_weight(layer: nn.Module) -> torch.Tensor:
    """The layer's weight in bf16, made on first use and again when the weight's storage changes."""
    key = layer.weight.data_ptr()
    cached = layer.__dict__.get("_bf16_weight")
    if cached is None or cached[0] != key:
        cached = layer.__dict__["_bf16_weight"] = (key, layer.weight.detach().to(torch.bfloat16))
    return cached[1]


class FloatLinear(nn.Linear):
    """nn.Linear whose products follow cpu_gemm_dtype as LinearBase's full-precision ones do (bf16
    for a prefill's or a large batch's rows, a bf16 checkpoint's exact bf16 rows for a few): for
    the families built from whole nn.Linear layers (the hybrids' linear-attention, Mamba2,
    attention and MLP projections). Under float32 products it is nn.Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FLOAT_METHOD.apply(self, x, self.bias)


class FloatLMHead(FloatLinear):
    """The hybrids' LM head: its logits as ParallelLMHead's (unquantized_head_logits), where
    FloatLinear's oneDNN pass would have rounded them to bf16 (past a decode step's few rows on a
    CPU without AMX, past the tiles' rows on one with it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return unquantized_head_logits(self, x) if self.bias is None and x.dim() == 2 else super().forward(x)


def float_swiglu_bf16(gate_up: nn.Module, down: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """down(SiLU(gate) * up) of x [rows, hidden] float32 for FloatLinear layers (gate_up's rows
    [gate | up], no biases) whose products are each one oneDNN bf16 pass (bf16_pass_takes: a
    prefill's rows): gate_up's bf16 result goes through SiLU * up in one compiled pass
    (native_rows.c) straight into down's bf16 input, where FloatLinear widened it to float32, ran
    SiLU and the product over float32 and rounded it back (a third of a Qwen3.5-shaped prefill's
    elementwise time). The same bf16 values in and out as that path's roundings, up to SiLU's
    exp. None where this does not apply (the caller runs its layers)."""
    rows = x.shape[0] if x.dim() == 2 else 0
    if not (isinstance(gate_up, FloatLinear) and isinstance(down, FloatLinear) and gate_up.bias is None
            and down.bias is None and x.dtype == torch.float32 and bf16_pass_takes(gate_up, rows)
            and bf16_pass_takes(down, rows)):
        return None
    act = silu_mul_bf16(bf16_product(gate_up, x, keep_bf16=True))
    return None if act is None else bf16_product(down, act, keep_bf16=False)


class UnquantizedConfig(QuantConfig):
    name = "none"

    def linear_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        return UnquantizedLinearMethod()


_FLOAT_METHOD = UnquantizedLinearMethod()
