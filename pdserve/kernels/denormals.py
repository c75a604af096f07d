"""Denormal floats flushed to zero around CPU code that makes many of them.

The recurrent layers' chunked forms decay values by e^(cum_i - cum_j) across a chunk, and on
strongly decaying heads whole blocks fall below float32's normal range (1.2e-38), where every
operation takes a microcode assist of about a hundred cycles: a Qwen3.5-shaped prefill's delta rule
ran 4-10x slower, a Mamba2 chunk 2.2x. What is flushed lies far below the float32 rounding of the
sums it enters. The compiled delta rule (native_delta.c) flushes inside itself; `flushed` does the
same for torch code, on this thread and its OpenMP pool's, and gives each its mode back after.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from pdserve.kernels import native_gemv


@contextlib.contextmanager
def flushed() -> Iterator[None]:
    """Denormals flushed (MXCSR's FTZ and DAZ) on torch's CPU threads inside the block; nothing
    changes without the compiled library."""
    lib = native_gemv.library()
    if lib is None:
        yield
        return
    threads = torch.get_num_threads()
    lib.pd_denormals_flush_threads(threads)
    try:
        yield
    finally:
        lib.pd_denormals_restore_threads(threads)
