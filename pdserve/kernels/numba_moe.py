"""A compiled grouped matmul for MoE steps with few rows per expert (CPU decode).

At decode a step holds a few (token, expert) pairs per expert, so each expert's matmul is a
handful of rows against its whole weight matrix. MKL's sgemm spends most of such a call on
setup and packing: measured on the 2-core development machine (one thread, 32 experts of
512x512 and 256x512, 7 layers), 32 tokens with top-4 routing took 48 ms a step in
torch._grouped_mm and 23 ms here; the two cross near 16 rows per expert (128 tokens), so
models.moe uses this kernel up to 8 rows per expert on average and _grouped_mm above that.

The kernel reads each expert's weight rows once per pair and keeps the pair's row in cache;
the sums run in a different order than MKL's, so results differ from _grouped_mm by float32
rounding (about 1e-6 relative), not by more.
"""
from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange

# Rows per expert, on average, up to which this kernel beats torch._grouped_mm (see above).
MAX_ROWS_PER_EXPERT = 8


def grouped_small_mm(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """rows [P, K] float32, grouped by expert; weight [E, N, K]; offs [E] int32, the cumulative
    row counts (expert e owns rows offs[e-1]..offs[e]) -> [P, N]: each row times its expert's
    weight transposed, as torch._grouped_mm(rows, weight.transpose(1, 2), offs=offs)."""
    out = torch.empty(rows.shape[0], weight.shape[1], dtype=torch.float32)
    _grouped_kernel(rows.detach().contiguous().numpy(), weight.detach().contiguous().numpy(),
                    offs.numpy(), out.numpy())
    return out


@njit(parallel=True, fastmath={"reassoc", "contract", "nsz"}, cache=True, nogil=True)
def _grouped_kernel(rows, weight, offs, out):  # pragma: no cover
    # One expert per work item; within it, each row against every weight row (the dot
    # product over K is contiguous in both, so it vectorises).
    for e in prange(weight.shape[0]):
        start = 0 if e == 0 else offs[e - 1]
        for m in range(start, offs[e]):
            for j in range(weight.shape[1]):
                acc = np.float32(0.0)
                for k in range(weight.shape[2]):
                    acc += rows[m, k] * weight[e, j, k]
                out[m, j] = acc


numba.config.THREADING_LAYER = "workqueue"  # as numba_ops: no OpenMP/TBB runtime needed
