"""The LMCache connector for pdserve's paged cache: one LMCache chunk = several whole blocks.

LMCache moves a chunk of tokens [start, end) between one of its MemoryObjs (format KV_2LTD:
[2, layers, tokens, heads*dim]; KV_MLA_FMT for a latent cache: [1, layers, tokens, dim]) and the
model's cache through a "GPU connector". pdserve's cache is block-major [blocks, layers, planes,
block_size, heads, dim] (planes: 2 for K/V, 1 for MLA's latent), so a chunk of C blocks is the
memory object viewed as [planes, layers, C, block_size, heads, dim], block j of it being one
cache block.
store()/retrieve() pass the kwargs kv_cache= and slot_mapping=, which here is a block table, not
LMCache's per-token slots: the cache block of every block position from token 0 of the call
(-1: leave that block alone, e.g. one already cached here). LMCache's hashes= store path insists
on a kwarg of that name and turns it into a tensor, and never reads it itself.
Plain torch copies, so CPU and GPU caches both work.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pdserve.kvstore.layout import KVLayout
from pdserve.kvstore.lmcache_compat import GPUConnectorInterface, MemoryObj


class PagedChunkConnector(GPUConnectorInterface):
    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        # Smallest chunk start whose MemoryObj had the wrong shape during the last load;
        # get() stops there rather than trusting it.
        self.bad_start: int | None = None

    def get_shape(self, num_tokens: int) -> torch.Size:
        lay = self.layout
        return torch.Size([lay.planes, lay.num_layers, num_tokens, lay.num_kv_heads * lay.head_dim])

    def _blocks_view(self, memory_obj: MemoryObj, start: int, end: int) -> torch.Tensor | None:
        """The object as [planes, layers, C, block_size, heads, dim], or None if it is not that."""
        lay, t = self.layout, memory_obj.tensor
        n = end - start
        if (t is None or t.dtype != lay.dtype or tuple(t.shape) != tuple(self.get_shape(n))
                or n % lay.block_size or start % lay.block_size):
            return None
        return t.view(lay.planes, lay.num_layers, n // lay.block_size, lay.block_size, lay.num_kv_heads, lay.head_dim)

    def _block_ids(self, kwargs: dict, start: int, end: int) -> Sequence[int]:
        bs = self.layout.block_size
        table = kwargs["slot_mapping"][start // bs:end // bs]
        return table.tolist() if isinstance(table, torch.Tensor) else table

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        dst = self._blocks_view(memory_obj, start, end)
        if dst is None:
            raise ValueError(f"LMCache allocated an unexpected MemoryObj for tokens [{start},{end})")
        cache = kwargs["kv_cache"]
        for j, block in enumerate(self._block_ids(kwargs, start, end)):
            dst[:, :, j].copy_(cache[int(block)].transpose(0, 1))

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        src = self._blocks_view(memory_obj, start, end)
        if src is None:
            self.bad_start = start if self.bad_start is None else min(self.bad_start, start)
            return
        cache = kwargs["kv_cache"]
        for j, block in enumerate(self._block_ids(kwargs, start, end)):
            if block >= 0:
                cache[int(block)].copy_(src[:, :, j].transpose(0, 1))

    def batched_from_gpu(self, memory_objs: Any, starts: list[int], ends: list[int], **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Any = None, starts: list[int] | None = None,
                       ends: list[int] | None = None, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs or [], starts or [], ends or []):
            self.to_gpu(obj, start, end, **kwargs)
