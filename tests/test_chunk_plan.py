"""chunk_plan: which blocks of a call are whole chunks (LMCache) and which are the tail."""
from __future__ import annotations

import pytest

from pdserve.kvstore.chunk_plan import chunks_to_get, chunks_to_put

BS, C = 16, 4  # 4 blocks per chunk


def full(n: int) -> list[int]:
    return [BS] * n


@pytest.mark.parametrize("first, counts, want", [
    (0, full(11), (0, 8)),               # 2 whole chunks, 3 blocks of tail
    (0, full(10) + [5], (0, 8)),         # a partial last block stays in the tail
    (0, full(7) + [5], (0, 4)),          # the second chunk holds the partial block: tail
    (0, full(3), (0, 0)),                # shorter than a chunk: all tail
    (2, full(9), (4, 8)),                # unaligned writer: blocks 2-3 have no chunk of their own
    (5, full(2), (8, 8)),                # no whole chunk at all
])
def test_chunks_to_put(first: int, counts: list[int], want: tuple[int, int]) -> None:
    span = chunks_to_put(first, counts, BS, C)
    assert (span.start, span.end) == want
    assert span.last_block_positions() == list(range(want[0] + C - 1, want[1], C))


@pytest.mark.parametrize("first, counts, want", [
    (0, full(11), (0, 8)),
    (6, full(5), (4, 8)),                # starts in the chunk holding block 6 (blocks 4-5 skipped)
    (6, full(1) + [3], (4, 4)),          # that chunk would need the partial block: none
    (8, full(3), (8, 8)),
])
def test_chunks_to_get(first: int, counts: list[int], want: tuple[int, int]) -> None:
    span = chunks_to_get(first, counts, BS, C)
    assert (span.start, span.end) == want
