"""The KV store interface: blocks of the paged cache keyed by their block key.

The paged cache is one block-major tensor: kv_cache[block_id] has shape
[num_layers, planes, block_size, num_kv_heads, head_dim] (planes 2: K and V per KV head; 1: an
MLA latent per token, see kvstore.layout.KVLayout) and is contiguous, so one block is one
contiguous byte range (one store value, one NIXL descriptor).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch


class KVStore(ABC):
    """Batched put/get of cache blocks under block keys (bytes from pdserve.protocol.block_keys)."""

    integrity_failures: int = 0  # blocks found but rejected by their checksum or digest

    @abstractmethod
    def put(self, keys: Sequence[bytes], kv_cache: torch.Tensor, block_ids: Sequence[int],
            num_tokens: Sequence[int], first_block: int = 0) -> None:
        """Store kv_cache[block_ids[i], :, :, :num_tokens[i]] under keys[i].
        num_tokens[i] < block_size marks a trailing partial block. first_block is the chain
        position of keys[0] (a store that groups blocks into chunks aligns on it)."""

    @abstractmethod
    def get(self, keys: Sequence[bytes], kv_cache: torch.Tensor, block_ids: Sequence[int],
            num_tokens: Sequence[int], first_block: int = 0) -> int:
        """Load keys[i] into kv_cache[block_ids[i]] for the longest leading run of keys that are
        present and intact (shape and checksum verified); returns how many blocks were loaded.
        first_block is the chain position of keys[0]: blocks before it are cached already and a
        chunked store leaves them alone."""

    @abstractmethod
    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys of the chain are present."""

    def shared_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading blocks of the chain (keys[0] is its first block) a put may skip:
        blocks every reader can load from the store's shared tier now. The default, 0, writes
        everything; a store answers more only where rewriting a present block changes nothing."""
        return 0

    def put_state(self, key: bytes, arena: torch.Tensor, slot: int) -> None:
        """Store a hybrid model's recurrent-state slot arena[slot] (a byte row,
        pdserve.engine.state_pool) under key (pdserve.protocol.block_keys.state_key). A slot is
        stored as a block of one token of its bytes, so it takes the block path's header,
        checksum and shape checks."""
        self.put([key], as_blocks(arena), [slot], [1])

    def get_state(self, key: bytes, arena: torch.Tensor, slot: int) -> bool:
        """Load the state stored under key into arena[slot]; False when it is missing or damaged."""
        return self.get([key], as_blocks(arena), [slot], [1]) == 1

    def has_states(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of these state keys the store holds."""
        return [self.lookup_prefix([key]) == 1 for key in keys]

    def close(self) -> None:  # noqa: B027 - optional hook: stores without connections keep it
        """Release connections and memory."""


def as_blocks(arena: torch.Tensor) -> torch.Tensor:
    """A state arena [slots, bytes] seen as a block-major cache of one-token blocks
    [slots, 1 layer, 1 plane, 1 token, 1 head, bytes], the shape the block stores take."""
    return arena.view(arena.shape[0], 1, 1, 1, 1, arena.shape[1])
