"""Maps requests to KV blocks: prefix-cache hits, allocation for new tokens, freeing."""
from __future__ import annotations

from pdserve.engine.block_keys import ROOT_KEY, block_key
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import PENDING_TOKEN, Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, salt: bytes):
        self.pool = pool
        self.block_size = block_size
        self.salt = salt

    def block_keys(self, req: Request) -> list[bytes]:
        """Keys of every full block of the request's tokens (cached on the request)."""
        keys, bs = req.block_keys, self.block_size
        tokens = req.all_token_ids
        known = len(tokens) - (tokens[-1] == PENDING_TOKEN if tokens else 0)  # a pending token has no key yet
        for i in range(len(keys), known // bs):
            parent = keys[-1] if keys else ROOT_KEY
            keys.append(block_key(parent, tokens[i * bs:(i + 1) * bs], self.salt))
        return keys

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Block ids of the longest cached prefix, leaving at least one token to compute so the
        request gets logits to sample from. None for a request that wants prompt logprobs:
        a cached block has no logits."""
        if req.sampling_params.prompt_logprobs is not None and not req.output_token_ids:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for key in self.block_keys(req)[:max_blocks]:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate(self, req: Request, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Give the request blocks for `cached` hits plus num_new_tokens more; False if short."""
        total = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        needed = -(-total // self.block_size) - len(req.block_ids) - len(cached)
        # Touching a hit that sits in the free queue takes it out of the free count.
        reclaimed = sum(1 for b in cached if self.pool.blocks[b].ref_cnt == 0)
        if needed > self.pool.num_free - reclaimed:
            return False
        self.pool.touch(list(cached))
        req.block_ids.extend(cached)
        if cached:  # hits are in the prefix cache already; blocks allocated earlier may not be yet
            req.num_registered_blocks = max(req.num_registered_blocks, len(req.block_ids))
        if needed > 0:
            req.block_ids.extend(self.pool.allocate(needed))
        return True

    def commit(self, req: Request) -> None:
        """Enter the request's newly computed full blocks into the prefix cache."""
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_registered_blocks:
            return
        keys = self.block_keys(req)
        for i in range(req.num_registered_blocks, full):
            self.pool.cache_block(req.block_ids[i], keys[i])
        req.num_registered_blocks = full

    def free(self, req: Request) -> None:
        self.pool.free(req.block_ids[::-1])
        req.block_ids = []
        req.num_registered_blocks = 0
