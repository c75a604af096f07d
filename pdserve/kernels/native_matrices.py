"""The compiled gemv's arguments for a model's torch weights (pdserve.kernels.native_gemv's matrix
tuple: pointer, rows, bits, scales, mins, half, has_min, group), for the layouts that are not
quant_cpu's (those come from native_gemv.matrix_args): float32 rows read as they are, and
gpt-oss's MXFP4 codes as pdserve.kernels.mxfp4_cpu holds them. The models hand them to the
compiled decode step (pdserve.kernels.native_decode)."""
from __future__ import annotations

import torch

from pdserve.kernels.native_gemv import BITS_FP4


def float32_on_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def float_matrix(weight: torch.Tensor) -> tuple | None:
    """The gemv's arguments for an unquantized matrix (float32 [N, K], its rows read as they are:
    bits 32, no scales), as native_gemv.matrix_args gives them for a quantized one; None where it is
    not contiguous float32 on CPU or its rows are not whole blocks of 32 columns (the gemv's unit).
    The caller keeps the tensor alive."""
    if not float32_on_cpu(weight) or weight.shape[1] % 32:
        return None
    # the scales pointer is never read at 32 bits; one group spans the row
    return (weight.data_ptr(), weight.shape[0], 32, weight.data_ptr(), None, 0, 0, weight.shape[1])


def fp4_matrix(codes: torch.Tensor, scales: torch.Tensor) -> tuple | None:
    """The gemv's arguments for an MXFP4 matrix as pdserve.kernels.mxfp4_cpu holds it (codes uint8
    [N, K / 2], E8M0 scales uint8 [N, K / 32]); None where either is not contiguous on CPU or the
    rows are not whole blocks of 32 columns. The caller keeps the tensors alive."""
    if not all(t.device.type == "cpu" and t.dtype == torch.uint8 and t.is_contiguous() for t in (codes, scales)):
        return None
    if scales.shape != (codes.shape[0], codes.shape[1] // 16) or codes.shape[1] % 16:
        return None
    return (codes.data_ptr(), codes.shape[0], BITS_FP4, scales.data_ptr(), None, 2, 0, 32)
