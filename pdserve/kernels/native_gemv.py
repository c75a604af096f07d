"""The decode steps' quantized matmul compiled from C (native_gemv.c): AVX-512 intrinsics, OpenMP.

Without AVX-512 (AVX2 with FMA and F16C: AMD before Zen 4, Intel's desktop parts), the same
sources compile to AVX2: native_simd.h defines the 512-bit intrinsics they use on pairs of
256-bit registers; the bf16, AMX and VNNI kernels are left out there.

A decode step multiplies a few tokens by every weight. numba's kernel (quant_gemv) widens the
nibbles and the scales lane by lane; the C kernel decodes a block of 32 columns in a few vector
instructions, keeps 2 rows x 8 tokens of sums in registers and prefetches the rows ahead. On
SmolLM2's shapes it is 1.3 to 2.5 times as fast as numba's from 1 to 32 tokens, and faster than
dequantizing tiles for BLAS up to 32 (benchmarks/kernels/bench_native_gemv.py). It computes the same float32
values, in another order of sums.

The library is compiled on first use with the machine's C compiler (`-march=native`) into
PDSERVE_CACHE_DIR/native, keyed by the source, the flags, the compiler and the CPU's flags, so a
second process loads it without compiling. Where there is no compiler, neither AVX-512 nor AVX2, or no source
(`PDSERVE_NATIVE_KERNELS=0` too), `library()` is None, one log line says why, and numba's kernel
runs instead.

OpenMP: the library's libgomp.so.1 binds the copy torch loaded first (the same soname), so its
parallel regions and torch's share one pool. numba's threading layer asks for libgomp.so.1.0.0 by
that name and gets the system's, a second pool: the many-token paths keep numba out of their
loops for that reason (native_tiles.c).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numba
import numpy as np
import torch  # noqa: F401 (loaded before the library, whose libgomp.so.1 then binds torch's: one pool)

from pdserve.cache_dir import cache_root
from pdserve.kernels import host_memory

log = logging.getLogger(__name__)

# native_decode.c (a decode step through every layer), native_attend.c (its paged attention),
# native_lora.c (its adapter deltas), native_moe.c (its MoE layers' MLP) and native_mla.c (its
# latent attention layers) are built into the same library: they call pd_gemv. Their header is hashed with them.
SOURCES = tuple(Path(__file__).with_name(name) for name in (
    "native_gemv.c", "native_decode.c", "native_attend.c", "native_lora.c", "native_moe.c", "native_mla.c", "native_tiles.c",
    "native_gemv_bf16.c", "native_gemv_amx.c", "native_gemv_int8.c", "native_gemv_int8_amx.c", "native_gemv_panels.c", "native_prefill.c",
    "native_prefill_amx.c", "native_prefill_dpbf16.c", "native_paged.c", "native_rows.c", "native_delta.c", "native_denormals.c",
    "native_recurrent.c"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("native_decode.h", "native_quant_blocks.h", "native_exp.h",
                                                            "native_bf16.h", "native_simd.h", "native_int8.h", "native_amx.h",
                                                            "native_prefill_bf16.h"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# PDSERVE_NATIVE_ISA=avx2 builds the AVX2 code on an AVX-512 CPU too (native_simd.h's pairs of
# 256-bit registers), so that path is tested on any machine (tests/test_native_avx2.py)
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",)}
_P, _I = ctypes.c_void_p, ctypes.c_int
MAX_TOKENS = 32  # above this, dequantized tiles through BLAS win (bench_native_gemv.py)
# ... except on an AVX2 build, whose panels (native_gemv_panels.c) ran 1.0-2.2x the tiles and BLAS
# from 48 to 256 tokens on SmolLM2's shapes (a 2-core EPYC without AVX-512, 2026-12-04)
PANELS_MAX_TOKENS = 256
# ... and where bf16 products run on AMX's tiles (32 rows dequantized a task, native_gemv_amx.c):
# against dequantized tiles through oneDNN (a whole-matrix tile for a layer's matrices), the Xeon
# VM, 2026-12-06, two threads, medians of 9 (ms): SmolLM2's four Q4_1 layer matrices 1.82 / 2.82 at
# 128 tokens, 3.68 / 4.42 at 256, 8.34 / 7.13 at 512; the Q8_0 [49,152, 576] LM head 18.9 / 27.6
# at 128, 46.4 / 49.6 at 256, 63.3 / 63.4 at 384 (benchmarks/kernels/bench_bf16_crossover.py)
AMX_MAX_TOKENS = 256
_amx_products = False  # set_bf16's: bf16 products, and the library was granted AMX's tiles


def _cache_dir() -> Path:
    return cache_root() / "native"


def _cpu_flags() -> str:
    """/proc/cpuinfo's flags line; under PDSERVE_NATIVE_ISA=avx2 without the AVX-512 and AMX
    flags, so that the rest of the process (dequant_tiles' bf16 and int8 choices) sees the CPU
    the library was built for."""
    line = platform.processor()
    try:
        line = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), line)
    except OSError:
        pass
    if os.environ.get("PDSERVE_NATIVE_ISA") == "avx2":
        line = " ".join(flag for flag in line.split() if not flag.startswith(("avx512", "amx")))
    return line


def _flags() -> tuple[str, ...]:
    isa = os.environ.get("PDSERVE_NATIVE_ISA", "native")
    if isa not in ISA_FLAGS:
        raise ValueError(f"PDSERVE_NATIVE_ISA={isa!r}: expected one of {', '.join(ISA_FLAGS)}")
    return FLAGS + ISA_FLAGS[isa]


def _build_key(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    h = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES + HEADERS))
    for part in (*_flags(), version, _cpu_flags(), platform.machine()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def _compile(compiler: str, target: Path) -> None:
    """Into a temporary file beside target, then renamed: processes that compile at once each
    write their own file, and a reader never sees half of one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_flags(), *map(str, SOURCES), "-o", tmp], capture_output=True, text=True, check=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _why_not() -> str | None:
    if os.environ.get("PDSERVE_NATIVE_KERNELS", "1") == "0":
        return "PDSERVE_NATIVE_KERNELS=0"
    flags = set(_cpu_flags().split())
    if platform.machine() not in ("x86_64", "AMD64") or not ({"avx512bw"} <= flags or {"avx2", "fma", "f16c"} <= flags):
        return "the CPU has neither AVX-512 nor AVX2 with FMA and F16C"
    missing = [source.name for source in SOURCES + HEADERS if not source.exists()]
    if missing:
        return f"{', '.join(missing)} is not installed"
    return None


def compiler() -> str | None:
    """The C compiler the kernel is built with: $CC (default cc), else gcc; None when neither is on PATH."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (numba's kernel runs) with one log line saying why."""
    reason = _why_not()
    compiler_path = compiler()
    if reason is None and compiler_path is None:
        reason = "no C compiler (cc, gcc) on PATH"
    if reason is None:
        try:
            path = _cache_dir() / f"native_gemv-{_build_key(compiler_path)}.so"
            if not path.exists():
                _compile(compiler_path, path)
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.CalledProcessError) as e:
            reason = f"it did not build or load: {getattr(e, 'stderr', None) or e}"
    if reason is not None:
        log.info("native quantized gemv unavailable (%s): numba's kernel runs instead", reason.strip()[:500])
        return None
    fn = lib.pd_gemv
    fn.argtypes = [_P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _P, _P, _I]
    fn.restype = _I
    lib.pd_int8_pack_bytes.argtypes = [_I, _I, _I, _I, _I]
    lib.pd_int8_pack_bytes.restype = ctypes.c_long
    lib.pd_int8_pack.argtypes = [_P, _I, _I, _I, _P, _P, _I, _I, _I, _P, _I]
    lib.pd_int8_pack.restype = _I
    lib.pd_gated_delta_chunked.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _I, _I]
    lib.pd_gated_delta_chunked.restype = _I
    lib.pd_bf16_tiles_bytes.argtypes = [_I, _I]
    lib.pd_bf16_tiles_bytes.restype = ctypes.c_long
    lib.pd_bf16_tiles_pack.argtypes = [_P, _I, _I, _P, _I]
    lib.pd_bf16_tiles_pack.restype = _I
    lib.pd_dequant_rows.argtypes = [_P, _I, _I, _P, _P, _I, _I, _I, _I, _I, _P, _I, _I]
    lib.pd_dequant_rows.restype = _I
    lib.pd_set_bf16.argtypes = [_I]
    lib.pd_set_bf16.restype = None
    lib.pd_amx_granted.argtypes = []
    lib.pd_amx_granted.restype = _I
    lib.pd_set_int8.argtypes = [_I]
    lib.pd_set_int8.restype = None
    lib.pd_round_bf16.argtypes = [_P, ctypes.c_long, ctypes.c_long, _P, _I]
    lib.pd_round_bf16.restype = _I
    lib.pd_widen_bf16.argtypes = [_P, ctypes.c_long, ctypes.c_long, _P, ctypes.c_long, _I]
    lib.pd_widen_bf16.restype = None
    lib.pd_set_attend_sequence_items_from.argtypes = [_I]
    lib.pd_set_attend_sequence_items_from.restype = _I
    lib.pd_argmax_rows.argtypes = [_P, ctypes.c_long, ctypes.c_long, ctypes.c_long, _P, _I]
    lib.pd_argmax_rows.restype = _I
    lib.pd_norm_rows.argtypes = [_P, _P, _P, _P, _P, ctypes.c_float, _I, _I, _P, _P, _I]
    lib.pd_norm_rows.restype = _I
    lib.pd_rope_rows.argtypes = [_P, ctypes.c_long, _I, _P, ctypes.c_long, _I, _I, _P, _P, _I, _I]
    lib.pd_rope_rows.restype = None
    lib.pd_widen_rope_rows.argtypes = [_P, _I, _I, _I, _I, _P, _P, _P, _I]
    lib.pd_widen_rope_rows.restype = None
    lib.pd_silu_mul_rows.argtypes = [_P, _I, _I, _P, _I]
    lib.pd_silu_mul_rows.restype = None
    lib.pd_silu_mul_bf16.argtypes = [_P, _I, _I, _P, _I]
    lib.pd_silu_mul_bf16.restype = _I
    lib.pd_store_kv_bf16.argtypes = [_P, ctypes.c_long, _P, ctypes.c_long, _I, _I, _P, _I, ctypes.c_long, _P, _P, _P, _P,
                                     _I]
    lib.pd_store_kv_bf16.restype = None
    # native_paged's and native_prefill's kernels, typed here with the rest so that their callers
    # take them from library() each call and follow it when a test switches the library off and on
    lib.pd_paged_attention.argtypes = [_P, ctypes.c_int64, _I, _I, _I, _I, _I, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_int64, ctypes.c_float, _P, _P, _I, ctypes.c_int64, _P, _P, _I, _P, _P, _I]
    lib.pd_paged_attention.restype = _I
    lib.pd_prefill_attention.argtypes = [_P, ctypes.c_long, _P, ctypes.c_long, _P, ctypes.c_long, _P, _P, _I, _I, _I, _I,
                                         ctypes.c_float, _P, _I]
    lib.pd_prefill_attention.restype = _I
    lib.pd_prefill_attention_prefixed.argtypes = [_P, ctypes.c_long, _P, ctypes.c_long, _P, ctypes.c_long, _P, _P, _P,
                                                  _P, _I, _I, _I, _I, ctypes.c_float, _P, _I]
    lib.pd_prefill_attention_prefixed.restype = _I
    lib.pd_prefill_attention_amx.argtypes = lib.pd_prefill_attention.argtypes
    lib.pd_prefill_attention_amx.restype = _I
    lib.pd_prefill_attention_amx_paged.argtypes = [_P, ctypes.c_long, _P, ctypes.c_long, _P, ctypes.c_long, _P, _P, _P,
                                                   _I, _I, _I, _I, ctypes.c_float, _P, _P, _I, ctypes.c_long, _P, _I,
                                                   _P, _I]
    lib.pd_prefill_attention_amx_paged.restype = _I
    lib.pd_prefill_attention_dpbf16.argtypes = lib.pd_prefill_attention.argtypes
    lib.pd_prefill_attention_dpbf16.restype = _I
    lib.pd_prefill_attention_dpbf16_paged.argtypes = lib.pd_prefill_attention_amx_paged.argtypes
    lib.pd_prefill_attention_dpbf16_paged.restype = _I
    fn = lib.pd_decode_layers
    fn.argtypes = [_P, _P, _I, _P, _P, _P, _P, _I, _P, _P, _P, _I]
    fn.restype = _I
    return lib


def set_bf16(on: bool) -> None:
    """Past TOKENS_PER_PASS tokens, integer layouts' products in bf16 (native_gemv.c's
    task_many_bf16) or float32; for this process (pdserve.kernels.dequant_tiles.set_tile_dtype)."""
    global _amx_products
    lib = library()
    if lib is not None:
        lib.pd_set_bf16(int(on))
        _amx_products = bool(on) and bool(lib.pd_amx_granted())


def set_int8(on: bool, min_tokens: int | None = None, max_tokens: int | None = None) -> None:
    """From min_tokens tokens (the library's default where None) up to max_tokens (None: no
    limit), 4- and 8-bit layouts' products in int8 with VNNI (native_gemv_int8.c), for this
    process (dequant_tiles.set_tile_dtype)."""
    lib = library()
    if lib is not None:
        lib.pd_set_int8(int(on))
        if min_tokens is not None:
            ctypes.c_int.in_dll(lib, "pd_int8_min_tokens").value = min_tokens
        ctypes.c_int.in_dll(lib, "pd_int8_max_tokens").value = max_tokens if max_tokens is not None else 1 << 30


def panels_built() -> bool:
    """Whether this build has native_gemv_panels.c's micro-kernel (AVX2 builds: AVX-512 ones decline)."""
    lib = library()
    return lib is not None and bool(ctypes.c_int.in_dll(lib, "pd_panels_built").value)


def max_tokens() -> int:
    """Up to how many tokens the compiled kernel beats dequantized tiles through BLAS here."""
    if panels_built():
        return PANELS_MAX_TOKENS
    return AMX_MAX_TOKENS if _amx_products else MAX_TOKENS


def set_panels_min_tokens(tokens: int) -> int:
    """From how many tokens an AVX2 build's products take native_gemv_panels.c's micro-kernel
    (benchmarks compare it with the tiles it replaces); returns the value it had."""
    lib = library()
    if lib is None:
        return 0
    setting = ctypes.c_int.in_dll(lib, "pd_panels_min_tokens")
    before, setting.value = setting.value, tokens
    return before


def set_int8_amx_min_tokens(tokens: int | None) -> int:
    """From how many tokens the int8 products read from a pack run on AMX's int8 tiles
    (native_gemv_int8_amx.c; the same values as VNNI's; None: unchanged); returns the value it had."""
    lib = library()
    if lib is None:
        return 0
    setting = ctypes.c_int.in_dll(lib, "pd_int8_amx_min_tokens")
    before = setting.value
    setting.value = before if tokens is None else tokens
    return before


def set_attend_sequence_items_from(tokens: int) -> int:
    """The decode attention's work items are whole sequences (their KV heads in turn) from this many
    sequences a step (0: native_attend.c's default, 4 a thread); returns the setting it replaced,
    -1 without the library. For benchmarks that alternate it in one process."""
    lib = library()
    return -1 if lib is None else lib.pd_set_attend_sequence_items_from(tokens)


def int8_amx_calls() -> int:
    """How many times a thread's int8 products have taken AMX's int8 tiles in this process."""
    lib = library()
    return 0 if lib is None else ctypes.c_long.in_dll(lib, "pd_int8_amx_calls").value


def matrix_args(bits: int, q: np.ndarray, scales: np.ndarray, mins: np.ndarray, has_min: bool,
                group: int) -> tuple | None:
    """The kernel's arguments that describe one weight matrix (pointers into its arrays, which the
    caller keeps alive), made once per matrix: building them costs microseconds a call. The last
    is its int8 pack's (with_int8_pack), None until one is made. None when the arrays are not
    contiguous."""
    if not (q.flags.c_contiguous and scales.flags.c_contiguous and mins.flags.c_contiguous):
        return None
    return (q.ctypes.data, q.shape[0], bits, scales.ctypes.data, mins.ctypes.data if has_min else None,
            int(scales.dtype == np.uint16), int(has_min), group, None)


def int8_pack(matrix: tuple, cols: int) -> np.ndarray | None:
    """The matrix's (matrix_args) codes and scales in the order the int8 products read them
    (native_gemv_int8.c's pd_int8_pack: as many bytes as the matrix, 64-byte aligned), made once so
    that no call gathers and transposes them; None where the library's int8 products do not take
    the matrix. The caller keeps it alive and passes it on with with_int8_pack."""
    lib = library()
    if lib is None:
        return None
    q, rows, bits, scales, mins, half, has_min, group, _ = matrix
    nbytes = lib.pd_int8_pack_bytes(rows, cols, bits, half, has_min)
    if nbytes <= 0:
        return None
    raw = np.empty(nbytes + 64, dtype=np.uint8)
    pack = raw[-raw.ctypes.data % 64:][:nbytes]  # (a view: it keeps raw alive)
    rc = lib.pd_int8_pack(q, rows, cols, bits, scales, mins, half, has_min, group, pack.ctypes.data,
                          numba.get_num_threads())
    if rc != 0:
        return None
    host_memory.collapse_later([(pack.ctypes.data, pack.ctypes.data + nbytes)])  # read whole by every decode step
    return pack


def with_int8_pack(matrix: tuple, pack: np.ndarray | None) -> tuple:
    """matrix_args' tuple whose products read `pack` (int8_pack), or none."""
    return (*matrix[:-1], None if pack is None else pack.ctypes.data)


def dequant_rows(matrix: tuple, cols: int, start: int, end: int, out_ptr: int, bf16: bool) -> bool:
    """Rows [start, end) of the matrix (matrix_args) dequantized into the contiguous buffer at
    out_ptr, float32 or bf16 (native_tiles.c); False where the library or the layout is not there."""
    lib = library()
    if lib is None:
        return False
    q, _, bits, scales, mins, half, has_min, group, _ = matrix
    return lib.pd_dequant_rows(q, cols, bits, scales, mins, half, has_min, group, start, end, out_ptr, int(bf16),
                               numba.get_num_threads()) == 0


BITS_FP4 = 3  # native_gemv.c's MXFP4 codes (pdserve.kernels.native_matrices.fp4_matrix)
BITS_BF16 = 16  # native_gemv.c's unquantized bf16 rows (pdserve.kernels.native_matrices.float_matrix)


def run(x_ptr: int, tokens: int, cols: int, matrix: tuple, out_ptr: int) -> bool:
    """out[:tokens, :N] = x[:tokens, :cols] @ w.T for contiguous float32 buffers at x_ptr and out_ptr.
    False when the library is unavailable or does not take this shape (nothing is written then)."""
    lib = library()
    if lib is None:
        return False
    return lib.pd_gemv(x_ptr, tokens, cols, *matrix, out_ptr, numba.get_num_threads()) == 0


def gemv(x: np.ndarray, bits: int, q: np.ndarray, scales: np.ndarray, mins: np.ndarray, has_min: bool,
         group: int) -> np.ndarray | None:
    """x [tokens, K] float32 @ w.T -> [tokens, N], with q, scales and mins as quant_cpu holds them
    (numpy arrays; scales and mins float32, or float16 bits as uint16); None where run is False."""
    matrix = matrix_args(bits, q, scales, mins, has_min, group)
    out = np.empty((x.shape[0], q.shape[0]), dtype=np.float32)
    if matrix is None or not x.flags.c_contiguous or not run(x.ctypes.data, x.shape[0], x.shape[1], matrix,
                                                                out.ctypes.data):
        return None
    return out
