"""Row passes of the compiled library (native_rows.c, native_tiles.c) over torch tensors: rounding
float32 rows to bf16, widening bf16 rows back, each row's argmax. Each runs on torch's threads and
falls back to torch's own operation (or None: the caller's) where the library cannot take it."""
from __future__ import annotations

import torch

from pdserve.kernels.native_gemv import library


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """x (float32, contiguous, on CPU) rounded to bf16 as x.to(torch.bfloat16) does (denormals
    flushed to zero), in torch's thread pool with AVX-512 (native_tiles.c); torch's own conversion
    where the library cannot."""
    lib = library()
    if lib is not None and x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 2:
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        if lib.pd_round_bf16(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads()) == 0:
            return out
    return x.to(torch.bfloat16)


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """Each row's index of its first largest value (x float32 [rows, cols] on CPU, columns
    contiguous), as torch's max(dim=-1).indices gives it, on torch's threads (native_rows.c); None
    where the library cannot (no library or no AVX-512, another layout, a NaN in a row)."""
    lib = library()
    if lib is None or not (x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu"
                           and x.stride(1) == 1 and x.shape[1] > 0):
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    rc = lib.pd_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out if rc == 0 else None


def widen_bf16_into(src: torch.Tensor, out: torch.Tensor) -> None:
    """out[:] = src (bf16 [rows, cols], contiguous) widened exactly to float32: out a [rows, cols]
    float32 view whose rows may be strided (columns of a wider output)."""
    lib = library()
    if lib is None or not (src.dtype == torch.bfloat16 and src.is_contiguous() and out.dtype == torch.float32
                           and out.stride(1) == 1):
        out.copy_(src)
        return
    lib.pd_widen_bf16(src.data_ptr(), src.shape[0], src.shape[1], out.data_ptr(), out.stride(0),
                      torch.get_num_threads())
