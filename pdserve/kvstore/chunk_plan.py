"""Which blocks of a call go to LMCache as whole chunks, and which through the tail path.

A chunk is C = chunk_tokens / block_size consecutive blocks aligned on the chain (blocks
[c*C, (c+1)*C)), all full, stored under the block key of its last block: that key hashes the
whole prefix up to it, so it names the chunk and everything before it. The rest of a prompt
(the trailing blocks after its last whole chunk, partial last block included) is the "tail":
resp:// values are fixed at a full chunk, so the tail goes block by block through the direct
Redis path, which keeps prefix reuse block-granular there.

Calls carry a slice of the chain: first_block is the chain position of keys[0].
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkSpan:
    """Chunks cover chain blocks [start, end); start may precede first_block (a get that skips
    blocks already cached: they are left alone), end never passes the slice."""

    start: int
    end: int
    chunk_blocks: int

    @property
    def num_chunks(self) -> int:
        return (self.end - self.start) // self.chunk_blocks

    def last_block_positions(self) -> list[int]:
        """Chain positions of each chunk's last block (the block whose key names the chunk)."""
        return [self.start + (c + 1) * self.chunk_blocks - 1 for c in range(self.num_chunks)]


def _whole_chunks_from(start: int, first_block: int, counts: Sequence[int], block_size: int,
                       chunk_blocks: int) -> ChunkSpan:
    end_of_slice = first_block + len(counts)
    end = start
    while end + chunk_blocks <= end_of_slice:
        lo = max(end, first_block) - first_block
        if any(n != block_size for n in counts[lo:end + chunk_blocks - first_block]):
            break
        end += chunk_blocks
    return ChunkSpan(start, end, chunk_blocks)


def chunks_to_put(first_block: int, counts: Sequence[int], block_size: int, chunk_blocks: int) -> ChunkSpan:
    """Whole chunks the writer holds every block of: they start at or after first_block."""
    start = -(-first_block // chunk_blocks) * chunk_blocks
    return _whole_chunks_from(start, first_block, counts, block_size, chunk_blocks)


def chunks_to_get(first_block: int, counts: Sequence[int], block_size: int, chunk_blocks: int) -> ChunkSpan:
    """Whole chunks holding the slice's leading blocks: the first may begin before first_block
    (blocks before a slice are always full: they are earlier blocks of the same prefix)."""
    start = first_block // chunk_blocks * chunk_blocks
    return _whole_chunks_from(start, first_block, counts, block_size, chunk_blocks)
