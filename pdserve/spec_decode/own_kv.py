"""A drafter's own paged KV cache and model runner (the draft model's, a head's)."""
from __future__ import annotations

import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.speculation import SpeculationHost
from pdserve.kernels import get_ops
from pdserve.kvstore.layout import KVLayout


def own_paged_runner(model, layout: KVLayout, host: SpeculationHost, salt: bytes
                     ) -> tuple[KVCacheManager, ModelRunner]:
    """As many blocks as the target's cache, without prefix caching (salt: keys never shared
    with the target's), and a runner of model over them."""
    block_size, num_blocks = host.config.block_size, host.kv_cache.shape[0]
    kv_cache = torch.zeros((num_blocks, *layout.block_shape()), dtype=layout.dtype, device=host.device)
    kv = KVCacheManager(BlockPool(num_blocks, enable_caching=False), block_size, salt)
    ops = get_ops(host.config.kernel_backend, host.device.type)
    return kv, ModelRunner(model, kv_cache, block_size, ops, host.device)
