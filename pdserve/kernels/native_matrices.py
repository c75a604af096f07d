"""The compiled gemv's arguments for a model's torch weights (pdserve.kernels.native_gemv's matrix
tuple: pointer, rows, bits, scales, mins, half, has_min, group), for the layouts that are not
quant_cpu's (those come from native_gemv.matrix_args): float32 rows read as they are, and
gpt-oss's MXFP4 codes as pdserve.kernels.mxfp4_cpu holds them. The models hand them to the
compiled decode step (pdserve.kernels.native_decode)."""
from __future__ import annotations

import torch

from pdserve.kernels import native_gemv
from pdserve.kernels.native_gemv import BITS_BF16, BITS_FP4


def float32_on_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def bf16_on_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous()


def float_matrix(weight: torch.Tensor) -> tuple | None:
    """The gemv's arguments for an unquantized matrix (float32 [N, K], its rows read as they are:
    bits 32, no scales), as native_gemv.matrix_args gives them for a quantized one; None where it is
    not contiguous float32 on CPU or its rows are not whole blocks of 32 columns (the gemv's unit).
    The caller keeps the tensor alive."""
    if not float32_on_cpu(weight) or weight.shape[1] % 32:
        return None
    # the scales pointer is never read at 32 bits; one group spans the row
    return (weight.data_ptr(), weight.shape[0], 32, weight.data_ptr(), None, 0, 0, weight.shape[1], None)


def bf16_matrix(rows: torch.Tensor) -> tuple | None:
    """The same for bf16 rows [N, K] that stand for float32 weights exactly (a bf16 checkpoint
    served in float32: pdserve.layers.quant.unquantized.exact_bf16_weight), widened as they are
    read (bits 16): half the bytes of the float32 rows. The caller keeps the tensor alive."""
    if not bf16_on_cpu(rows) or rows.shape[1] % 32:
        return None
    return (rows.data_ptr(), rows.shape[0], BITS_BF16, rows.data_ptr(), None, 0, 0, rows.shape[1], None)


def fp4_matrix(codes: torch.Tensor, scales: torch.Tensor) -> tuple | None:
    """The gemv's arguments for an MXFP4 matrix as pdserve.kernels.mxfp4_cpu holds it (codes uint8
    [N, K / 2], E8M0 scales uint8 [N, K / 32]); None where either is not contiguous on CPU or the
    rows are not whole blocks of 32 columns. The caller keeps the tensors alive."""
    if not all(t.device.type == "cpu" and t.dtype == torch.uint8 and t.is_contiguous() for t in (codes, scales)):
        return None
    if scales.shape != (codes.shape[0], codes.shape[1] // 16) or codes.shape[1] % 16:
        return None
    return (codes.data_ptr(), codes.shape[0], BITS_FP4, scales.data_ptr(), None, 2, 0, 32, None)


def bf16_rows_matmul(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
    """x [T, K] float32 @ rows.T for bf16 rows [N, K], through the compiled gemv (bits 16: each row
    widened exactly, float32 sums); None where the library or the shape does not take them."""
    matrix = bf16_matrix(rows)
    if matrix is None or x.dim() != 2 or not float32_on_cpu(x) or x.shape[1] != rows.shape[1]:
        return None
    out = torch.empty(x.shape[0], rows.shape[0])
    return out if native_gemv.run(x.data_ptr(), x.shape[0], x.shape[1], matrix, out.data_ptr()) else None
