"""Maps requests to KV blocks: prefix-cache hits, allocation for new tokens, freeing.

For a model whose every attention layer slides (window W: the query at position i sees keys
i-W+1..i), a block whose tokens all lie before the next query's window is read by no layer
again: slide() returns it to the pool (with its prefix-cache key, like any freed block) and
puts SLID_OUT in its place in the request's block table, which no kernel reads.

For a hybrid model (linear-attention or Mamba layers beside attention), each request also holds
one slot of the state pool (pdserve.engine.state_pool) with its blocks: taken by its first
allocation, given back whenever its blocks are freed (finish, abort, preemption). With prefix
caching, a cached prefix is taken only as far as a snapshot of the state after its last block
exists (pdserve.engine.state_snapshots), which restores the request's slot. A request whose KV
lands from elsewhere takes its slot with its landing blocks: the state lands in it with them.
"""
from __future__ import annotations

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import PENDING_TOKEN, Request
from pdserve.engine.state_pool import StatePool
from pdserve.engine.state_snapshots import StateSnapshots
from pdserve.protocol.block_keys import ROOT_KEY, block_key
from pdserve.protocol.multimodal import block_extra

SLID_OUT = -1  # a block-table entry whose block left every layer's window and went back to the pool


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, salt: bytes, window: int = 0, whole_images: bool = False,
                 states: StatePool | None = None, snapshots: StateSnapshots | None = None):
        self.pool = pool
        self.states = states  # a hybrid model's state slots; None for attention-only models
        self.snapshots = snapshots  # ... and their copies at block boundaries, with prefix caching
        self.block_size = block_size
        self.salt = salt
        # > 0: every layer slides and none looks further back than this (0: some layer is full).
        self.window = window
        # The model's image tokens attend bidirectionally (Gemma 3: model.bidirectional_images):
        # an image's tokens are computed together, so no prefix hit nor prefill chunk ends
        # inside one (the scheduler reads this too).
        self.whole_images = whole_images

    def block_keys(self, req: Request) -> list[bytes]:
        """Keys of every full block of the request's tokens (cached on the request), salted with
        the request's own salt (a tenant's, an adapter's) where it has one, and holding the keys
        of the images whose tokens each block covers."""
        keys, bs = req.block_keys, self.block_size
        salt = req.salt or self.salt
        tokens = req.all_token_ids
        known = len(tokens) - (tokens[-1] == PENDING_TOKEN if tokens else 0)  # a pending token has no key yet
        for i in range(len(keys), known // bs):
            parent = keys[-1] if keys else ROOT_KEY
            extra = block_extra(req.images, i * bs, (i + 1) * bs) if req.images else b""
            keys.append(block_key(parent, tokens[i * bs:(i + 1) * bs], salt, extra))
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
        while hits and self.whole_images and inside_image(req, len(hits) * self.block_size):
            hits.pop()
        if self.states is not None:  # a hybrid model also needs the state after the last hit
            keys = req.block_keys
            while hits and (self.snapshots is None or keys[len(hits) - 1] not in self.snapshots):
                hits.pop()
        return hits

    def allocate(self, req: Request, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Give the request blocks for `cached` hits plus num_new_tokens more; False if short."""
        total = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        needed = -(-total // self.block_size) - len(req.block_ids) - len(cached)
        # Touching a hit that sits in the free queue takes it out of the free count.
        reclaimed = sum(1 for b in cached if self.pool.blocks[b].ref_cnt == 0)
        if needed > self.pool.num_free - reclaimed or not self._take_state_slot(req):
            return False
        self.pool.touch(list(cached))
        req.block_ids.extend(cached)
        if cached:  # hits are in the prefix cache already; blocks allocated earlier may not be yet
            req.num_registered_blocks = max(req.num_registered_blocks, len(req.block_ids))
            if self.snapshots is not None:  # (find_cached_prefix took hits only as far as a snapshot)
                self.snapshots.restore(self.block_keys(req)[len(req.block_ids) - 1], req.state_slot)
        if needed > 0:
            req.block_ids.extend(self.pool.allocate(needed))
        return True

    def _take_state_slot(self, req: Request) -> bool:
        """A hybrid model's request holds a state slot before it computes; False: none free."""
        if self.states is None or req.state_slot is not None:
            return True
        req.state_slot = self.states.allocate()
        return req.state_slot is not None

    def allocate_landing(self, req: Request, num_tokens: int, cached: list[int], horizon: int) -> bool:
        """Blocks for the first num_tokens tokens of a request (holding none yet) whose KV lands
        from elsewhere: cached hits first, fresh blocks for the rest; False if short. Blocks out
        of the window of the query at `horizon` are neither allocated nor taken from the cache:
        nothing lands in them (SLID_OUT)."""
        num_blocks = -(-num_tokens // self.block_size)
        dead = min(self.num_dead_blocks(horizon), num_blocks)
        hits = list(cached[dead:])
        needed = num_blocks - max(dead, len(cached))
        reclaimed = sum(1 for b in hits if self.pool.blocks[b].ref_cnt == 0)
        if needed > self.pool.num_free - reclaimed or not self._take_state_slot(req):
            return False
        self.pool.touch(hits)
        req.block_ids = [SLID_OUT] * dead + hits + self.pool.allocate(max(needed, 0))
        req.num_slid_blocks = dead
        req.num_registered_blocks = len(cached)  # hits are cached already; SLID_OUT is skipped
        if cached and self.snapshots is not None:  # the state after the hits, until more lands
            self.snapshots.restore(self.block_keys(req)[len(cached) - 1], req.state_slot)
        return True

    def restore_state(self, req: Request) -> bool:
        """A hybrid request's slot made to match its computed tokens again (its state landing from
        elsewhere failed): zeroed at its next step when none are, else the snapshot after its
        cached prefix; False when that snapshot is gone (the request must start over)."""
        if self.states is None or req.num_computed_tokens == 0:
            return True
        full = req.num_computed_tokens // self.block_size
        key = self.block_keys(req)[full - 1]
        if self.snapshots is None or req.num_computed_tokens != full * self.block_size or key not in self.snapshots:
            return False
        self.snapshots.restore(key, req.state_slot)
        return True

    def commit(self, req: Request, snapshot: bool = True) -> None:
        """Enter the request's newly computed full blocks into the prefix cache, then free the
        blocks that slid out of the window (a sliding-window model). snapshot=False: the slot
        does not hold the state at the request's computed tokens (KV landed ahead of it)."""
        full = req.num_computed_tokens // self.block_size
        if full > req.num_registered_blocks:
            keys = self.block_keys(req)
            for i in range(req.num_registered_blocks, full):
                if req.block_ids[i] != SLID_OUT:  # (a handover skipped it: never held here)
                    self.pool.cache_block(req.block_ids[i], keys[i])
            req.num_registered_blocks = full
            if snapshot and self.snapshots is not None and req.num_computed_tokens == full * self.block_size:
                self.snapshots.save(req.state_slot, keys[full - 1])  # the state exactly at the boundary
        self.slide(req)

    def num_dead_blocks(self, num_tokens: int) -> int:
        """Leading blocks no query from position num_tokens on can see: every token of block j
        is at most num_tokens - W, the last position out of the window of query num_tokens."""
        if not self.window:
            return 0
        return max(num_tokens - self.window + 1, 0) // self.block_size

    def slide(self, req: Request, num_tokens: int | None = None) -> None:
        """Free the blocks that slid out of the window of the request's next query (at position
        num_tokens, its computed tokens by default). Call after commit: a freed block keeps its
        prefix-cache key, so a later prompt with the same prefix can still take it back."""
        dead = min(self.num_dead_blocks(req.num_computed_tokens if num_tokens is None else num_tokens),
                   len(req.block_ids))
        if dead <= req.num_slid_blocks:
            return
        gone = req.block_ids[req.num_slid_blocks:dead]
        self.pool.free([b for b in gone[::-1] if b != SLID_OUT])
        req.block_ids[req.num_slid_blocks:dead] = [SLID_OUT] * len(gone)
        req.num_slid_blocks = dead

    def free(self, req: Request) -> None:
        self.pool.free([b for b in req.block_ids[::-1] if b != SLID_OUT])
        if req.state_slot is not None:
            self.states.free(req.state_slot)
            req.state_slot = None
        req.block_ids = []
        req.num_registered_blocks = 0
        req.num_slid_blocks = 0


def inside_image(req: Request, position: int) -> bool:
    """A cut before `position` falls strictly inside one of the request's images."""
    return any(im.offset < position < im.end for im in req.images)
