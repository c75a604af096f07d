"""The matmul of every quantized CPU kernel above its gemv's token count: dequantize a tile of
weight rows into a reused buffer (about 1 MB, so it stays in cache) and multiply it with BLAS.
Each kernel passes the function that fills a tile (float32) from its own format.

The tile's product runs in float32, or in bfloat16 (float32 accumulation) where the CPU has
native bf16 dot products: AMX tiles (Sapphire Rapids and later) or AVX-512 BF16 (Zen 4, Cooper
Lake). oneDNN, under torch's bf16 matmul, takes those: a [455, 576] x [576, 512] tile product
ran at 193 GFLOP/s in float32 and 765 in bf16 on a 2-core Zen 4 (AVX-512 BF16, no AMX). bf16
rounds the activations, the dequantized weights and each product to 8 significant bits, as vLLM's
CPU backend does (llama.cpp rounds activations to 8 bits), so greedy text can differ from the
float32 reference where two tokens' logits nearly tie: float32 keeps every product in float32
(the engine's `cpu_gemm_dtype`, auto by default: bf16 where the CPU has it; set here per process
with set_tile_dtype).
The tiles serve prefill and any step past the compiled decode step's rows; decode steps within
them stay in float32 (native_gemv.c).

int8 (`cpu_gemm_dtype int8`, CPUs with AVX-512 VNNI): 4- and 8-bit matrices skip the tiles at
every row count and multiply int8-rounded activations in the compiled kernel
(native_gemv_int8.c, llama.cpp's arithmetic); the other matrices' tiles run bf16."""
from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache

import numpy as np
import torch

from pdserve.kernels import native_gemv, native_rows

TILE_BYTES = 1 << 20
# bf16 tiles hold a whole matrix up to this size (SmolLM2's MLP is 3.4 MB): oneDNN's bf16 product
# does not read a tile back from cache as BLAS does a float32 one, and a 2,048-token prefill ran 15%
# faster with one product a matrix than with 455-row tiles (16 products a layer, each widened apart)
BF16_TILE_BYTES = 8 << 20
_tiles: dict[int, np.ndarray] = {}  # columns -> the reused float32 tile buffer
_tile_dtype = torch.float32
_int8 = False  # cpu_gemm_dtype int8: 4- and 8-bit matrices' products in int8 (native_gemv_int8.c)
# Up to how many rows int8 products run where the CPU has AMX: past it AMX's bf16 tiles multiply a
# 4-bit matrix faster than VNNI's vpdpbusd. The Xeon VM, SmolLM2's decode step over a bf16 cache,
# int8 against bf16 (ms): 12.6/17.9 at 4 requests, 16.6/24.6 at 8, 24.5/34.7 at 16, 41.4/43.3 at
# 32, 61.8/61.0 at 48, 81.2/74.6 at 64; a prefill 1,130-1,240 against 2,080-2,430 tokens/s. Those
# int8 steps were VNNI's: with AMX's int8 tiles (native_gemv_int8_amx.c, later), the default GGUF's
# decode step over its bf16 cache, offline, 2026-12-06 (int8 / bf16 tiles, two runs each): 41.5,
# 40.6 / 51.0, 58.0 ms at 48 requests; 72.8, 64.1 / 64.1, 79.6 at 56; 75.1, 77.9 / 64.0, 71.6 at 64.
INT8_MAX_ROWS_AMX = 48
_int8_max_rows: int | None = None  # set_tile_dtype's: INT8_MAX_ROWS_AMX under int8 with AMX, else None
GEMM_DTYPE_ENV = "PDSERVE_CPU_GEMM_DTYPE"  # what cpu_gemm_dtype auto means, where set


@cache
def _cpu_flags() -> frozenset[str]:
    """/proc/cpuinfo's flags, as the compiled kernels were built for them (native_gemv)."""
    return frozenset(native_gemv._cpu_flags().split()) - {"flags", ":"}


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX or AVX-512 BF16)."""
    return bool({"amx_bf16", "avx512_bf16"} & _cpu_flags())


def avx512_bf16() -> bool:
    """Whether this CPU rounds float32 to bf16 in AVX-512 (vcvtne2ps2bf16: the compiled rounding)."""
    return "avx512_bf16" in _cpu_flags()


def native_amx() -> bool:
    """Whether this CPU has AMX's bf16 tiles."""
    return "amx_bf16" in _cpu_flags()


def native_int8() -> bool:
    """Whether this CPU has AVX-512 VNNI's int8 dot products (vpdpbusd)."""
    return "avx512_vnni" in _cpu_flags()


def resolve_gemm_dtype(name: str, gguf: bool = False) -> torch.dtype:
    """The dtype named (auto, float32, bfloat16 or int8); bfloat16 on a CPU without native bf16 dot
    products is refused (oneDNN would emulate it, slower than float32), int8 without VNNI. auto:
    $PDSERVE_CPU_GEMM_DTYPE where set (the test suite pins float32 there, for its float32
    references); else for a GGUF checkpoint int8 where the CPU has VNNI (llama.cpp's arithmetic
    for its blocks; where it has AMX too, only up to INT8_MAX_ROWS_AMX rows, bf16 tiles past
    them), and otherwise bfloat16 where the CPU multiplies it natively, as vLLM's
    CPU backend runs, and float32 elsewhere."""
    if name == "auto":
        name = os.environ.get(GEMM_DTYPE_ENV) or (
            "int8" if gguf and native_int8() else "bfloat16" if native_bf16() else "float32")
    if name == "bfloat16" and not native_bf16():
        raise ValueError("cpu_gemm_dtype bfloat16 needs a CPU with AMX or AVX-512 BF16 (/proc/cpuinfo's "
                         "amx_bf16 or avx512_bf16); this one has neither: use float32")
    if name == "int8" and not native_int8():
        raise ValueError("cpu_gemm_dtype int8 needs a CPU with AVX-512 VNNI (/proc/cpuinfo's avx512_vnni); "
                         "this one has none: use bfloat16 or float32")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}[name]


def set_tile_dtype(dtype: torch.dtype) -> None:
    """The dtype the products run in, for this process (set as an engine is built). int8: the 4-
    and 8-bit matrices' products in int8, every other product in bf16 where the CPU has it."""
    global _tile_dtype, _int8, _int8_max_rows
    _int8 = dtype == torch.int8
    _tile_dtype = (torch.bfloat16 if native_bf16() else torch.float32) if _int8 else dtype
    _int8_max_rows = INT8_MAX_ROWS_AMX if _int8 and native_amx() else None
    if _tile_dtype != torch.float32 or _int8 or native_gemv.library.cache_info().currsize:  # (float32: load it only if loaded)
        native_gemv.set_bf16(_tile_dtype == torch.bfloat16)
        native_gemv.set_int8(_int8, max_tokens=_int8_max_rows)


def tile_dtype() -> torch.dtype:
    """The dtype of the tiles' products (bf16 or float32; bf16 under int8 where the CPU has it)."""
    return _tile_dtype


def gemm_dtype() -> torch.dtype:
    """The dtype set_tile_dtype was given: what a TP worker is told to run."""
    return torch.int8 if _int8 else _tile_dtype


def int8_products(rows: int | None = None) -> bool:
    """Whether 4- and 8-bit matrices multiply in int8 (the compiled kernel): at some row count
    (rows None), or at `rows` (where the CPU has AMX, up to INT8_MAX_ROWS_AMX; past it bf16 tiles)."""
    return _int8 and (rows is None or _int8_max_rows is None or rows <= _int8_max_rows)


def matmul_by_tiles(x: torch.Tensor, rows: int, fill_tile: Callable[[int, int, np.ndarray], None],
                    min_rows: int = 16, native: tuple | None = None) -> torch.Tensor:
    """x [tokens, K] float32 @ w.T -> [tokens, rows] float32; fill_tile(start, end, tile) writes
    rows start..end of w, dequantized, into tile [end - start, K] (float32). native: the matrix's
    native_gemv.matrix_args, whose tiles the compiled library dequantizes instead where it takes
    them (native_tiles.c: in torch's thread pool, not numba's, and straight into bf16)."""
    cols = x.shape[1]
    tile_rows = max(min_rows, TILE_BYTES // (4 * cols))
    if native is not None and native_gemv.library() is not None and x.is_contiguous():
        bf16 = _tile_dtype == torch.bfloat16
        if bf16:
            tile_rows = min(rows, max(tile_rows, BF16_TILE_BYTES // (2 * cols)))
        tile = torch.empty(tile_rows, cols, dtype=_tile_dtype)
        out = _tile_products(x, rows, tile, lambda start, end: native_gemv.dequant_rows(
            native, cols, start, end, tile.data_ptr(), bf16))
        if out is not None:
            return out
    buffer = _tiles.get(cols)
    if buffer is None or buffer.shape[0] < tile_rows:
        buffer = _tiles[cols] = np.empty((tile_rows, cols), dtype=np.float32)
    buffer = buffer[:tile_rows]

    def fill(start: int, end: int) -> bool:
        fill_tile(start, end, buffer[:end - start])
        return True
    return _tile_products(x, rows, torch.from_numpy(buffer), fill)


def bf16_product(x: torch.Tensor, native: tuple, rows: int, keep_bf16: bool) -> torch.Tensor | None:
    """x [tokens, K] (float32, or bf16 already) @ w.T under bf16 tiles, w the quantized matrix
    (native_gemv.matrix_args) dequantized whole to bf16: [tokens, rows], bf16 where keep_bf16 (no
    widening: the MLP's gate_up result goes to SiLU * up as it is), else float32. None where the
    library or the matrix's size (past BF16_TILE_BYTES) does not allow one tile."""
    cols = x.shape[1]
    if _tile_dtype != torch.bfloat16 or native_gemv.library() is None or rows * cols * 2 > BF16_TILE_BYTES:
        return None
    tile = torch.empty(rows, cols, dtype=torch.bfloat16)
    return _tile_products(x.contiguous(), rows, tile, lambda start, end: native_gemv.dequant_rows(
        native, cols, start, end, tile.data_ptr(), True), keep_low=keep_bf16)


def silu_mul_bf16(gate_up: torch.Tensor) -> torch.Tensor | None:
    """SiLU(gate) * up of a bf16 product's rows gate_up [rows, 2 * I] (gate first) in one compiled
    pass (native_rows.c), bf16 in and out: what passes between a bf16 MLP's two products, which
    need not widen it. None without the library or for I not in sixteens."""
    lib = native_gemv.library()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    act = torch.empty(rows, inter, dtype=torch.bfloat16)
    gate_up = gate_up.contiguous()
    if lib is None or lib.pd_silu_mul_bf16(gate_up.data_ptr(), rows, inter, act.data_ptr(), torch.get_num_threads()) != 0:
        return None
    return act


def _tile_products(x: torch.Tensor, rows: int, tile: torch.Tensor, fill: Callable[[int, int], bool],
                   keep_low: bool = False) -> torch.Tensor | None:
    """x @ w.T, w's rows filled tile by tile into `tile` by fill(start, end) (False: it does not
    take this matrix, and the result is None). In float32 each tile's product is a contiguous
    slice of the [N, tokens] output; in _tile_dtype (float32 sums rounded by torch's matmul; x
    float32, or in _tile_dtype already) it is widened straight into its columns of the output, or
    where keep_low (one tile for all of w) returned as it is."""
    tile_rows, low = tile.shape[0], _tile_dtype != torch.float32
    if low:
        out = None if keep_low else torch.empty(x.shape[0], rows)
        x_low = (x if x.dtype == _tile_dtype else
                 native_rows.round_bf16(x) if _tile_dtype == torch.bfloat16 else x.to(_tile_dtype))
    else:
        out_t = torch.empty(rows, x.shape[0])
    if keep_low and (not low or tile_rows < rows):
        return None
    for start in range(0, rows, tile_rows):
        end = min(rows, start + tile_rows)
        if not fill(start, end):
            return None
        filled = tile[:end - start]
        if keep_low:
            return torch.mm(x_low, filled.to(_tile_dtype).T)
        if low:
            native_rows.widen_bf16_into(torch.mm(x_low, filled.to(_tile_dtype).T), out[:, start:end])
        else:
            torch.mm(filled, x.T, out=out_t[start:end])
    return out if low else out_t.T.contiguous()
