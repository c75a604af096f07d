"""The CPU KV pool's memory: a fresh anonymous mapping, and when its pages are first written.

A step that writes KV into a page nobody wrote before pays the kernel's zeroing and, in a VM, the
hypervisor backing it, inside the step, one fault per page. Three ways the pool meets that:
- `prefault`: every page written at start (prefault_pages), as vLLM allocates its cache. The
  default where the operator gave the pool's size: that memory is reserved for it.
- the default pool (a share of the machine's memory) is written just ahead of use (WriteAhead):
  the block pool hands out never-used blocks in index order, so when it reaches one past the
  written frontier the next POOL_WRITE_AHEAD_BYTES are written in one madvise call. The pool
  holds only the memory its blocks have used, as before, and no step faults page by page.
- on other devices, torch.zeros.

On the 2-core Xeon VM (AMX), an offline prefill of 128 x 160 tokens into fresh blocks of a 4 GiB
pool took 9.7-10.6 s written on first use in huge pages (the kernel compacting memory for them),
8.2-9.4 s in 4 KiB pages, 7.4-7.9 s written ahead, 6.6-8.3 s with the pool written at start:
populating costs 0.35 s a GiB in 4 KiB pages, where first writes inside the step cost several
times that.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import time

import torch

from pdserve.kernels.host_memory import libc_madvise

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # Linux 5.14; Python's mmap module names it from 3.13 on
POOL_WRITE_AHEAD_BYTES = 64 << 20  # a 2,048-token prefill of SmolLM2 writes ~47 MB of bf16 KV
PAGE = mmap.PAGESIZE


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                prefault: bool = False) -> torch.Tensor:
    """A zeroed KV pool. On CPU, a fresh anonymous mapping, which the kernel zeroes as its pages
    are first written: a pool sized to the machine's memory costs only the blocks used, where
    torch.zeros would write every page at start. `prefault`: every page written now, in 4 KiB
    pages, then transparent huge pages asked for (khugepaged may merge them later); else the
    pages stay 4 KiB, written ahead of use (WriteAhead): asking for huge pages there made the
    kernel compact memory inside steps (3.8 s for a fresh 2 GiB, against 0.7 s in 4 KiB pages)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (shared would be shmem: no THP)
    if prefault:
        prefault_pages(pages, nbytes)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                pages.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps `pages`


def prefault_pages(pages: mmap.mmap, nbytes: int) -> None:
    """Write every page of the pool now, in 4 KiB pages. A prefill writing KV into fresh pages
    paid the kernel's zeroing and, in a VM, the hypervisor backing them, inside the step (with a
    4 GiB pool on the 2-core Zen 4 VM: 23% of a prefill's samples in clear_page; served tokens/s
    at 32 streams about 210 -> 250). Not as huge pages: with the machine's memory fragmented, the
    kernel compacts memory for each one (4 GiB populated in 21-36 s there, against 2.2 s in 4 KiB
    pages). The kernel populates the range in one call where it can; else torch writes zeros."""
    start = time.perf_counter()
    try:
        pages.madvise(MADV_POPULATE_WRITE, 0, nbytes)
    except OSError:  # an older kernel: EINVAL
        torch.frombuffer(pages, dtype=torch.uint8).zero_()
    log.info("KV pool: %.2f GiB written at start in %.1f s", nbytes / 2**30, time.perf_counter() - start)


class WriteAhead:
    """Writes a CPU pool's pages a chunk ahead of the highest block handed out (BlockPool's
    fresh_hook): one madvise(MADV_POPULATE_WRITE) per POOL_WRITE_AHEAD_BYTES. Where the kernel
    refuses it, the pages are left to be written on first use, as before."""

    def __init__(self, pool: torch.Tensor, chunk_bytes: int = POOL_WRITE_AHEAD_BYTES):
        self.base = pool.data_ptr()
        self.total = pool.numel() * pool.element_size()
        self.block_bytes = self.total // pool.shape[0]
        # (a small pool, a test's, is written a sixteenth at a time, not whole at its first block)
        self.chunk = max(PAGE, min(chunk_bytes, self.total // 16) // PAGE * PAGE)
        self.written = 0  # bytes from the start, a multiple of PAGE (or the whole pool)
        self._madvise = libc_madvise()

    def __call__(self, block_id: int) -> None:
        end = (block_id + 1) * self.block_bytes
        if end <= self.written or self._madvise is None:
            return
        target = min(self.total, -(-max(end, self.written + self.chunk) // PAGE) * PAGE)
        if self._madvise(ctypes.c_void_p(self.base + self.written), ctypes.c_size_t(target - self.written),
                         MADV_POPULATE_WRITE) != 0:
            self._madvise = None  # an older kernel (EINVAL): first writes fault as they come
            return
        self.written = target

