"""KVLayout: the shape facts a store needs to size, check and describe cache blocks."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.protocol.block_keys import kv_entry_dims, kv_layer_count, kv_layout_salt


@dataclass(frozen=True)
class KVLayout:
    """Layout of the block-major paged cache [num_blocks, num_layers, planes, block_size,
    kv_heads, head_dim]: planes 2 for K and V per KV head, or 1 for one latent per token (MLA,
    with kv_heads 1 and head_dim = kv_lora_rank + qk_rope_head_dim; see
    pdserve.protocol.block_keys.kv_entry_dims). Frozen so one layout object can be shared between
    stores and nodes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.float32
    model_name: str = "pdserve"
    planes: int = 2

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def block_shape(self, num_tokens: int | None = None) -> tuple[int, int, int, int, int]:
        """Shape of one stored block value holding num_tokens tokens (default: a full block)."""
        n = self.block_size if num_tokens is None else num_tokens
        return (self.num_layers, self.planes, n, self.num_kv_heads, self.head_dim)

    def block_nbytes(self, num_tokens: int | None = None) -> int:
        numel = 1
        for d in self.block_shape(num_tokens):
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()

    def salt(self) -> bytes:
        """The block-key salt for this layout (see pdserve.protocol.block_keys)."""
        return kv_layout_salt(self.model_name, self.num_layers, self.num_kv_heads, self.head_dim,
                              self.dtype_name, self.block_size, self.planes)

    @classmethod
    def for_model(cls, hf_config, block_size: int, dtype: torch.dtype, model_name: str) -> KVLayout:
        """The layout an engine allocates for a transformers config (a hybrid model's attention
        layers only: kv_layer_count)."""
        planes, heads, dim = kv_entry_dims(hf_config)
        return cls(kv_layer_count(hf_config), heads, dim, block_size, dtype, model_name, planes)

    @classmethod
    def from_cache(cls, kv_cache: torch.Tensor, model_name: str = "pdserve") -> KVLayout:
        """Read the layout off a paged cache tensor [blocks, layers, planes, block, heads, dim]."""
        if kv_cache.dim() != 6 or kv_cache.shape[2] not in (1, 2):
            raise ValueError(f"not a block-major paged cache: shape {tuple(kv_cache.shape)}")
        _, layers, planes, block, heads, dim = kv_cache.shape
        return cls(layers, heads, dim, block, kv_cache.dtype, model_name, planes)


def check_batch(keys: object, block_ids: object, num_tokens: object) -> None:
    """put/get take three parallel sequences; a length mismatch is a caller bug, so fail loudly
    rather than zip() silently dropping blocks."""
    lens = {len(keys), len(block_ids), len(num_tokens)}  # type: ignore[arg-type]
    if len(lens) != 1:
        raise ValueError(f"keys/block_ids/num_tokens lengths differ: "
                         f"{len(keys)}/{len(block_ids)}/{len(num_tokens)}")  # type: ignore[arg-type]
