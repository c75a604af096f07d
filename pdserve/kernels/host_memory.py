"""An engine's host memory on CPU: glibc's large blocks kept for reuse, the weights in huge pages.

By default glibc serves an allocation over 128 KiB-32 MiB (its mmap threshold, which it raises as
it goes) from a fresh mapping and returns the mapping on free, so every step's large activations
(a 2048-token prefill's [2048, 3072] MLP product is 25 MB) are written into fresh pages, each
faulted in and zeroed by the kernel. On this VM that made a bf16 tile product of SmolLM2's MLP
take 17.7 ms where the same work on warm memory took 11.0 (kernels/dequant_tiles.py). vLLM's CPU
backend asks for tcmalloc through LD_PRELOAD for the same reason; mallopt does it in-process.

The weights, which every decode step reads whole, are moved into 2 MiB pages once loaded
(weights_in_huge_pages; each int8 pack as native_gemv makes it). The kernel gives transparent
huge pages only to memory that asks for them (`madvise` mode, these VMs' setting), so the heap
the weights live in was in 4 KiB pages: a TLB miss every 4 KiB of the stream. The KV pool stays
in 4 KiB pages: written ahead in huge pages (pool_pages), it decoded 128 requests 5-7% faster but
prefilled into fresh blocks 15% slower on the same VM."""
from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

log = logging.getLogger(__name__)

MADV_COLLAPSE = 25  # Linux 6.1: the range's pages copied into huge pages now, whatever THP's mode
HUGE_PAGE = 2 << 20
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Allocations up to this size come from the heap, and up to this much free heap is kept.
KEEP_BYTES = 1 << 30


def keep_large_allocations() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where there is no glibc."""
    # (libc from the process's own symbols: ctypes.util.find_library runs ldconfig, ~76 ms)
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    done = (mallopt is not None and mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) == 1
            and mallopt(M_TRIM_THRESHOLD, KEEP_BYTES) == 1)
    if not done:
        log.debug("mallopt unavailable: large activations come from fresh pages each step")
    return done


def weights_in_huge_pages(tensors: Iterable[torch.Tensor]) -> Future:
    """The spans that hold these CPU tensors' storages collapsed into huge pages (collapse_later);
    storages less than a huge page apart are one span. On the 2-core Xeon VM (AMX), SmolLM2's GGUF
    decode step (offline, 200-token prompts) with its weights and int8 packs collapsed took 7.1 ms
    against 8.0 at one request, 38.9 against 40.1 at 32; 98 MiB collapsed in 0.3 s."""
    start = time.perf_counter()
    done = collapse_later(_spans(tensors))
    done.add_done_callback(lambda f: log.info("weights: %.0f MiB in huge pages in %.2f s", f.result() / 2**20,
                                              time.perf_counter() - start))
    return done


def collapse_later(spans: Iterable[tuple[int, int]]) -> Future:
    """collapse_spans on a thread of its own (the kernel copies the pages while the caller goes on
    loading: a start-up is one thread of Python); the future's result is the bytes collapsed. A
    collapse keeps every byte where it is, so memory freed meanwhile comes to no harm."""
    return _collapser().submit(collapse_spans, list(spans))


@functools.cache
def _collapser() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="huge-pages")


def collapse_spans(spans: Iterable[tuple[int, int]]) -> int:
    """Each [start, end) byte span's memory moved into 2 MiB pages now (MADV_COLLAPSE: the same
    bytes, a TLB entry per 2 MiB), its edges rounded out to whole huge pages (the neighbours'
    bytes there move with it, unchanged). Returns the bytes collapsed; 0 where the kernel (before
    6.1) or libc does not offer it."""
    madvise = libc_madvise()
    done = 0
    for lo, hi in spans if madvise is not None else ():
        lo, hi = lo // HUGE_PAGE * HUGE_PAGE, -(-hi // HUGE_PAGE) * HUGE_PAGE
        if madvise(lo, hi - lo, MADV_COLLAPSE) != 0 and ctypes.get_errno() == 22:  # EINVAL: before 6.1
            return done
        done += hi - lo  # (EAGAIN or ENOMEM: some pages stay small; the rest were collapsed)
    return done


@functools.cache
def libc_madvise():
    """libc's madvise through ctypes (it releases the GIL while the kernel works), from the symbols
    this process has loaded (ctypes.util.find_library would run ldconfig: 76 ms an engine build);
    None where there is none. The KV pool's WriteAhead (assembly/pool_pages) takes it too."""
    madvise = getattr(ctypes.CDLL(None, use_errno=True), "madvise", None)
    if madvise is not None:
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
    return madvise


def _spans(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """[start, end) of the tensors' CPU storages, those less than a huge page apart joined"""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if t.device.type == "cpu" and t.untyped_storage().nbytes() > 0}
    spans: list[list[int]] = []
    for lo, n in sorted(storages.items()):
        if spans and lo - spans[-1][1] < HUGE_PAGE:
            spans[-1][1] = max(spans[-1][1], lo + n)
        else:
            spans.append([lo, lo + n])
    return [(lo, hi) for lo, hi in spans]
