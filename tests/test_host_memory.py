"""The weights a decode step reads whole, in 2 MiB pages (pdserve.kernels.host_memory): a span's
memory collapsed into huge pages keeps its bytes, on the caller's thread or the collapsing
thread; an engine's loaded weights and the int8 packs native_gemv makes are the spans collapsed."""
from __future__ import annotations

import mmap
import platform

import numpy as np
import pytest
import torch
from smaps import mapping_bytes

from pdserve import LLM
from pdserve.kernels import dequant_tiles, host_memory, native_gemv

KERNEL = tuple(int(part) for part in platform.release().split(".")[:2] if part.isdigit())
needs_collapse = pytest.mark.skipif(KERNEL < (6, 1), reason="MADV_COLLAPSE is Linux 6.1's")


def huge_bytes(address: int) -> int:
    return mapping_bytes(address, "AnonHugePages")


@needs_collapse
def test_a_span_moves_into_huge_pages_with_its_bytes():
    pages = mmap.mmap(-1, 8 * host_memory.HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    data = torch.frombuffer(pages, dtype=torch.uint8)
    data.copy_(torch.randint(0, 256, data.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    before = data.clone()
    base = data.data_ptr()
    assert huge_bytes(base) == 0  # (this VMA never asked for huge pages: 4 KiB as written)
    lo = -(-base // host_memory.HUGE_PAGE) * host_memory.HUGE_PAGE + 100  # inside the second huge page
    assert host_memory.collapse_spans([(lo, lo + 3 * host_memory.HUGE_PAGE)]) == 4 * host_memory.HUGE_PAGE
    assert huge_bytes(base) >= 3 * host_memory.HUGE_PAGE  # (EAGAIN may leave a page small)
    assert torch.equal(data, before)
    later = data[-host_memory.HUGE_PAGE:]
    assert host_memory.collapse_later([(later.data_ptr(), later.data_ptr() + 1)]).result() == host_memory.HUGE_PAGE
    assert huge_bytes(base) >= 4 * host_memory.HUGE_PAGE and torch.equal(data, before)
    del data, later


def test_storages_less_than_a_huge_page_apart_are_one_span():
    a, b = torch.empty(1000, dtype=torch.uint8), torch.empty(10 << 20, dtype=torch.uint8)
    spans = host_memory._spans([a, a[10:], b])
    covered = [(lo, hi) for lo, hi in spans if lo <= a.data_ptr() and a.data_ptr() + 1000 <= hi]
    assert len(covered) == 1 and all(lo <= b.data_ptr() and b.data_ptr() + b.numel() <= hi for lo, hi in spans
                                     if lo <= b.data_ptr() < hi)
    assert host_memory._spans([torch.empty(0)]) == []


def test_an_engine_collapses_its_weights_and_int8_packs(monkeypatch):
    spans: list[tuple[int, int]] = []

    collapse_later = host_memory.collapse_later

    def record(given):
        spans.extend(given)
        return collapse_later([])
    monkeypatch.setattr(host_memory, "collapse_later", record)
    llm = LLM("builtin:tiny", kv_cache_memory_gb=0.0625)
    model = llm.engine.model
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        assert any(lo <= storage.data_ptr() and storage.data_ptr() + storage.nbytes() <= hi for lo, hi in spans)
    if native_gemv.library() is None or not dequant_tiles.native_int8():
        return
    dequant_tiles.set_tile_dtype(torch.int8)  # (conftest.py puts it back after the test)
    rng = np.random.default_rng(0)
    q = rng.integers(0, 256, (64, 128), dtype=np.uint8)
    scales = rng.random((64, 8), dtype=np.float32).astype(np.float16)
    matrix = native_gemv.matrix_args(4, q, scales, np.zeros_like(scales), True, 32)
    pack = native_gemv.int8_pack(matrix, 256)
    assert pack is not None and (pack.ctypes.data, pack.ctypes.data + pack.nbytes) in spans
