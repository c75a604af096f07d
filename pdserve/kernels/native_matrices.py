"""The compiled gemv's arguments for a model's torch weights (pdserve.kernels.native_gemv's matrix
tuple: pointer, rows, bits, scales, mins, half, has_min, group), for the layouts that are not
quant_cpu's (those come from native_gemv.matrix_args): float32 rows read as they are, and
gpt-oss's MXFP4 codes as pdserve.kernels.mxfp4_cpu holds them. The models hand them to the
compiled decode step (pdserve.kernels.native_decode)."""
from __future__ import annotations

import torch

from pdserve.kernels import host_memory, native_gemv
from pdserve.kernels.dequant_tiles import native_amx
from pdserve.kernels.native_gemv import BITS_BF16, BITS_FP4


def float32_on_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def bf16_on_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous()


def float_matrix(weight: torch.Tensor, tiles: torch.Tensor | None = None) -> tuple | None:
    """The gemv's arguments for an unquantized matrix (float32 [N, K], its rows read as they are:
    bits 32, no scales), as native_gemv.matrix_args gives them for a quantized one; its bf16
    products on AMX read tiles (bf16_tiles of its rows rounded to bf16) where given. None where it
    is not contiguous float32 on CPU or its rows are not whole blocks of 32 columns (the gemv's
    unit). The caller keeps the tensors alive."""
    if not float32_on_cpu(weight) or weight.shape[1] % 32:
        return None
    pack = None if tiles is None else tiles.data_ptr()
    # the scales pointer is never read at 32 bits; one group spans the row
    return (weight.data_ptr(), weight.shape[0], 32, weight.data_ptr(), None, 0, 0, weight.shape[1], pack)


def bf16_matrix(rows: torch.Tensor, tiles: torch.Tensor | None = None) -> tuple | None:
    """The same for bf16 rows [N, K] that stand for float32 weights exactly (a bf16 checkpoint
    served in float32: pdserve.layers.quant.unquantized.exact_bf16_weight), widened as they are
    read (bits 16): half the bytes of the float32 rows. Their AMX products read tiles (bf16_tiles)
    where given. The caller keeps the tensors alive."""
    if not bf16_on_cpu(rows) or rows.shape[1] % 32:
        return None
    pack = None if tiles is None else tiles.data_ptr()
    return (rows.data_ptr(), rows.shape[0], BITS_BF16, rows.data_ptr(), None, 0, 0, rows.shape[1], pack)


def bf16_tiles(rows: torch.Tensor) -> torch.Tensor | None:
    """bf16 rows [N, K] laid out once as AMX's B tiles (native_gemv_amx.c's pd_bf16_tiles_pack: as
    many bytes as the rows, 64-byte aligned), so that a product of 9 or more rows on the tiles loads
    them as they are instead of copying and transposing every row a call; None without AMX, the
    library or a shape it takes."""
    lib = native_gemv.library()
    if lib is None or not native_amx() or not bf16_on_cpu(rows):
        return None
    nbytes = lib.pd_bf16_tiles_bytes(rows.shape[0], rows.shape[1])
    if nbytes <= 0:
        return None
    raw = torch.empty(nbytes + 64, dtype=torch.uint8)
    pack = raw[-raw.data_ptr() % 64:][:nbytes]  # (a view: it keeps raw alive)
    if lib.pd_bf16_tiles_pack(rows.data_ptr(), rows.shape[0], rows.shape[1], pack.data_ptr(), torch.get_num_threads()):
        return None
    host_memory.collapse_later([(pack.data_ptr(), pack.data_ptr() + nbytes)])  # read whole by every step
    return pack


def fp4_matrix(codes: torch.Tensor, scales: torch.Tensor) -> tuple | None:
    """The gemv's arguments for an MXFP4 matrix as pdserve.kernels.mxfp4_cpu holds it (codes uint8
    [N, K / 2], E8M0 scales uint8 [N, K / 32]); None where either is not contiguous on CPU or the
    rows are not whole blocks of 32 columns. The caller keeps the tensors alive."""
    if not all(t.device.type == "cpu" and t.dtype == torch.uint8 and t.is_contiguous() for t in (codes, scales)):
        return None
    if scales.shape != (codes.shape[0], codes.shape[1] // 16) or codes.shape[1] % 16:
        return None
    return (codes.data_ptr(), codes.shape[0], BITS_FP4, scales.data_ptr(), None, 2, 0, 32, None)


def bf16_rows_matmul(x: torch.Tensor, rows: torch.Tensor, tiles: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [T, K] float32 @ rows.T for bf16 rows [N, K], through the compiled gemv (bits 16: each row
    widened exactly, float32 sums; past 8 rows under bf16 products, x rounded to bf16 on AMX tiles,
    from `tiles` where given); None where the library or the shape does not take them."""
    matrix = bf16_matrix(rows, tiles)
    if matrix is None or x.dim() != 2 or not float32_on_cpu(x) or x.shape[1] != rows.shape[1]:
        return None
    out = torch.empty(x.shape[0], rows.shape[0])
    return out if native_gemv.run(x.data_ptr(), x.shape[0], x.shape[1], matrix, out.data_ptr()) else None
