"""Digests of KV blocks: how both sides of a handover check that the bytes they moved are the bytes
that were computed (xxh3_64 of each block, compared with the digests its handover carries)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import xxhash


def _block_bytes(blocks: torch.Tensor, i: int) -> memoryview:
    # uint8 view first: numpy has no bfloat16, and this avoids a copy for contiguous blocks.
    return memoryview(blocks[i].contiguous().reshape(-1).view(torch.uint8).numpy())


def block_digest(kv_cache: torch.Tensor, block_ids: Iterable[int]) -> list[int]:
    """xxh3_64 (seed 0) of each block's bytes; equal on both sides iff the bytes are equal."""
    ids = [int(b) for b in block_ids]
    if kv_cache.device.type == "cpu":  # hashed in place
        return [xxhash.xxh3_64_intdigest(_block_bytes(kv_cache, b)) for b in ids]
    host = kv_cache[ids].cpu()  # GPU blocks: gathered and copied to the host once
    return [xxhash.xxh3_64_intdigest(_block_bytes(host, i)) for i in range(len(ids))]


def mismatched_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int],
                      digests: Sequence[int]) -> list[int]:
    """Positions i where kv_cache[block_ids[i]] does not match digests[i]."""
    if len(block_ids) != len(digests):
        raise ValueError(f"{len(digests)} digests for {len(block_ids)} blocks")
    actual = block_digest(kv_cache, block_ids)
    return [i for i, (a, e) in enumerate(zip(actual, digests)) if a != e]
