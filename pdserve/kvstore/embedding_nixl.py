"""Image embeddings over NIXL (E/P/D): an encoder node keeps what it encoded in a registered
arena, and the prefill node READs them from there into its own arena, one-sided.

Both arenas are one block-major byte tensor [num_blocks, block_nbytes], a block holding
BLOCK_ROWS embedding rows of the model's hidden size in the engine's dtype, so NixlKVAgent
(pdserve.kvstore.nixl_transfer) moves them as it moves KV blocks: regions as plain ints, a digest
per block checked after the READ, and a notification that tells the encoder node the reader is
done. An image takes ceil(rows / BLOCK_ROWS) blocks, the last one padded.

The encoder's arena doubles as a cache, least recently used out first: a repeated image is
handed over from the blocks it already has. Blocks named in a handover stay pinned until the
reader's notification or the lease's end; a READ of blocks reused since fails its digests, and the
reader then encodes the image itself.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.kvstore.block_digest import block_digest, mismatched_blocks
from pdserve.kvstore.nixl_transfer import NixlKVAgent, NixlTransferError

log = logging.getLogger(__name__)
BLOCK_ROWS = 16  # embedding rows a block holds: an image wastes less than one block
MIN_ARENA_ROWS = 4096  # an arena holds at least this many rows, whatever the encoder cache's budget
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def block_nbytes(hidden_size: int, dtype: torch.dtype) -> int:
    return BLOCK_ROWS * hidden_size * torch.empty((), dtype=dtype).element_size()


class BlockArena:
    """A registered byte tensor cut into equal blocks, with a free list."""

    def __init__(self, name: str, rows: int, hidden_size: int, dtype: torch.dtype):
        num_blocks = -(-max(rows, MIN_ARENA_ROWS) // BLOCK_ROWS)
        self.hidden_size, self.dtype = hidden_size, dtype
        self.row_nbytes = block_nbytes(hidden_size, dtype) // BLOCK_ROWS
        self.tensor = torch.zeros(num_blocks, block_nbytes(hidden_size, dtype), dtype=torch.uint8)
        self.agent = NixlKVAgent(name, self.tensor)
        self.free: list[int] = list(range(num_blocks))

    @property
    def block_nbytes(self) -> int:
        return self.agent.block_nbytes

    def blocks_for(self, rows: int) -> int:
        return -(-rows // BLOCK_ROWS)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        ids, self.free = self.free[:n], self.free[n:]
        return ids

    def release(self, ids: list[int]) -> None:
        self.free.extend(ids)

    def write(self, ids: list[int], embeddings: torch.Tensor) -> None:
        """Rows into blocks ids in order; the last block's tail is zeroed (its digest covers it).
        The bytes move through numpy: torch's indexed copies of a few blocks ran 1000x slower on
        a loaded 2-core machine (its thread pool), numpy's are plain memcpys."""
        data = embeddings.detach().to("cpu", self.dtype).contiguous().reshape(-1).view(torch.uint8).numpy()
        arena, per = self.tensor.numpy(), self.block_nbytes
        for i, block in enumerate(ids):
            chunk = data[i * per:(i + 1) * per]
            arena[block, :chunk.size] = chunk
            arena[block, chunk.size:] = 0

    def read(self, ids: list[int], rows: int) -> torch.Tensor:
        """A copy of the first `rows` embedding rows held in blocks ids."""
        data = np.concatenate([self.tensor.numpy()[block] for block in ids])[:rows * self.row_nbytes]
        return torch.from_numpy(data).view(self.dtype).reshape(rows, self.hidden_size)

    def close(self) -> None:
        self.agent.close()


@dataclass
class Published:
    """One image's embeddings in the encoder's arena."""
    block_ids: list[int]
    rows: int
    digests: list[int]
    leases: set[str] = field(default_factory=set)  # lease ids that pin the blocks


class EmbeddingPublisher:
    """The encoder node's side: images' embeddings in the arena by content hash, pinned per
    handover (lease id) until the reader's notification or lease_s."""

    def __init__(self, name: str, rows: int, hidden_size: int, dtype: torch.dtype, lease_s: float):
        self.arena = BlockArena(name, rows, hidden_size, dtype)
        self.lease_s = lease_s
        self.entries: OrderedDict[str, Published] = OrderedDict()
        self.leases: dict[str, tuple[str, float]] = {}  # lease id -> (content hash, monotonic expiry)
        self.leases_expired = 0

    def publish(self, content_hash: str, embeddings: torch.Tensor, lease_id: str) -> Published | None:
        """The image's entry, pinned under lease_id (written now unless the arena holds it); None
        when the arena has no room left that is not pinned."""
        entry = self.entries.get(content_hash)
        if entry is None:
            ids = self._room(self.arena.blocks_for(embeddings.shape[0]))
            if ids is None:
                return None
            self.arena.write(ids, embeddings)
            entry = Published(ids, int(embeddings.shape[0]), block_digest(self.arena.tensor, ids))
            self.entries[content_hash] = entry
        self.entries.move_to_end(content_hash)
        entry.leases.add(lease_id)
        self.leases[lease_id] = (content_hash, time.monotonic() + self.lease_s)
        return entry

    def _room(self, n: int) -> list[int] | None:
        """n free blocks, evicting unpinned images least recently used first."""
        while len(self.arena.free) < n:
            victim = next((h for h, e in self.entries.items() if not e.leases), None)
            if victim is None:
                return None
            self.arena.release(self.entries.pop(victim).block_ids)
        return self.arena.alloc(n)

    def poll(self) -> None:
        """Unpin what readers are done with (their notifications) and what outlived its lease."""
        for _peer, note in self.arena.agent.get_notifications():
            self._unpin(note.decode(errors="replace"))
        now = time.monotonic()
        for lease_id in [k for k, (_, expiry) in self.leases.items() if expiry <= now]:
            self.leases_expired += 1
            self._unpin(lease_id)

    def _unpin(self, lease_id: str) -> None:
        content_hash, _ = self.leases.pop(lease_id, (None, 0.0))
        entry = self.entries.get(content_hash) if content_hash is not None else None
        if entry is not None:
            entry.leases.discard(lease_id)

    def close(self) -> None:
        self.arena.close()


class EmbeddingFetcher:
    """The reader's side: READ an image's blocks from a peer's arena into this one, check their
    digests, and copy the rows out (the blocks are free again at once)."""

    def __init__(self, name: str, rows: int, hidden_size: int, dtype: torch.dtype):
        self.arena = BlockArena(name, rows, hidden_size, dtype)
        self.integrity_failures = 0

    def fetch(self, peer: str, regions: list[tuple[int, int, int]], digests: list[int], rows: int,
              notif: bytes, timeout_s: float) -> torch.Tensor | None:
        """The image's [rows, hidden] embeddings, or None when the READ fails or the bytes are not
        the ones handed over (the caller then encodes the image)."""
        if len(regions) != self.arena.blocks_for(rows) or len(digests) != len(regions):
            log.warning("an embedding handover of %d regions for %d rows: not read", len(regions), rows)
            return None
        ids = self.arena.alloc(len(regions))
        if ids is None:
            log.warning("no room for %d embedding rows in the arena: not read", rows)
            return None
        try:
            handle = self.arena.agent.start_read(peer, regions, ids, notif=notif, timeout_s=timeout_s)
            self.arena.agent.wait(handle)
            if mismatched_blocks(self.arena.tensor, ids, digests):
                self.integrity_failures += 1
                log.warning("embedding blocks from %s failed their digest check", peer)
                return None
            return self.arena.read(ids, rows)
        except (NixlTransferError, ValueError, IndexError) as exc:
            log.warning("embedding READ from %s failed: %s", peer, exc)
            return None
        finally:
            self.arena.release(ids)

    def close(self) -> None:
        self.arena.close()
