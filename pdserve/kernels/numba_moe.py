"""A compiled grouped matmul for MoE steps with few rows per expert (CPU decode).

At decode a step holds a few (token, expert) pairs per expert, so each expert's matmul is a
handful of rows against its whole weight matrix. MKL's sgemm spends most of such a call on
setup and packing: measured on the 2-core development machine (one thread, 32 experts of
512x512 and 256x512, 7 layers), 32 tokens with top-4 routing took 48 ms a step in
torch._grouped_mm and 23 ms in the first version of this kernel; the two crossed near 16 rows
per expert (128 tokens), so models.moe uses this kernel up to 8 rows per expert on average and
_grouped_mm above that (not re-measured for the present version, which is faster).

Each weight row is read from memory once per step: the kernel takes it against all of its
expert's rows, four at a time, while it sits in L1 (the first version took each row against
every weight row and so read the weights once per row). In decode steps of the model above,
alternating with the first version in one process, steps were 5-10% faster. Work items are
blocks of weight rows, so two threads share every step evenly. The sums run in a different
order than MKL's, so results differ from _grouped_mm by float32 rounding (about 1e-6
relative), not by more.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from pdserve.kernels import numba_threads  # noqa: F401  (before the first parallel call)

# Rows per expert, on average, up to which this kernel beats torch._grouped_mm (see above).
MAX_ROWS_PER_EXPERT = 8
# Weight rows per parallel work item: small enough that two threads split every step evenly.
ROWS_PER_ITEM = 64


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
    experts, n, k_dim = weight.shape
    chunks = (n + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
    # Work items are (block of weight rows, expert), the block outermost: prange gives each
    # thread a contiguous range, so every thread gets every expert's share of the work.
    for item in prange(chunks * experts):
        e = item % experts
        start = 0 if e == 0 else offs[e - 1]
        end = offs[e]
        first = (item // experts) * ROWS_PER_ITEM
        for j in range(first, min(first + ROWS_PER_ITEM, n)):
            w = weight[e, j]  # streamed from memory once, then read from L1 for every row
            for m in range(start, end, 4):
                # Four rows per pass (a short block repeats its last row): w[k] is loaded once
                # for four products.
                m1, m2, m3 = min(m + 1, end - 1), min(m + 2, end - 1), min(m + 3, end - 1)
                r0, r1, r2, r3 = rows[m], rows[m1], rows[m2], rows[m3]
                a0 = a1 = a2 = a3 = np.float32(0.0)
                for k in range(k_dim):
                    x = w[k]
                    a0 += r0[k] * x
                    a1 += r1[k] * x
                    a2 += r2[k] * x
                    a3 += r3[k] * x
                out[m3, j] = a3
                out[m2, j] = a2
                out[m1, j] = a1
                out[m, j] = a0
