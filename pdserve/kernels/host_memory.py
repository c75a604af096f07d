"""glibc's allocator for an engine's process on CPU: large blocks kept for reuse.

By default glibc serves an allocation over 128 KiB-32 MiB (its mmap threshold, which it raises as
it goes) from a fresh mapping and returns the mapping on free, so every step's large activations
(a 2048-token prefill's [2048, 3072] MLP product is 25 MB) are written into fresh pages, each
faulted in and zeroed by the kernel. On this VM that made a bf16 tile product of SmolLM2's MLP
take 17.7 ms where the same work on warm memory took 11.0 (kernels/dequant_tiles.py). vLLM's CPU
backend asks for tcmalloc through LD_PRELOAD for the same reason; mallopt does it in-process."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Allocations up to this size come from the heap, and up to this much free heap is kept.
KEEP_BYTES = 1 << 30


def keep_large_allocations() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        done = libc.mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) == 1 and libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES) == 1
    except (OSError, AttributeError):
        done = False
    if not done:
        log.debug("mallopt unavailable: large activations come from fresh pages each step")
    return done
