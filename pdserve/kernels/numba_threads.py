"""The threading layer of pdserve's compiled (numba) kernels, chosen once for all of them.

OpenMP first: a parallel kernel call costs about 3.5 us to launch there against about 175 us
in numba's own workqueue layer (measured on the 2-core development machine), and a CPU decode
step launches about three kernels per layer. With OpenMP, the Qwen3-MoE benchmark model's
decode steps took 35% less time (docs/models.md). The workqueue layer needs no OpenMP runtime
(libgomp), so it stays as the fallback where none is installed. TBB comes last (numba wants
all three listed), so it is never reached: it is not a dependency, and which layer runs should
not depend on whether some other package pulled it in.

GNU OpenMP is not fork-safe: a process that has run a parallel kernel must not fork a child
that runs one without exec. pdserve starts its nodes with exec (subprocess, Ray workers).
"""
from __future__ import annotations

import numba

numba.config.THREADING_LAYER_PRIORITY = ["omp", "workqueue", "tbb"]
numba.config.THREADING_LAYER = "default"  # the first of the priority list that loads
