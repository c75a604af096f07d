"""Upper bounds on the share of prompt tokens a prefix cache can serve, from a trace alone.

Each request is its list of full blocks (chained keys: a key stands for its whole prefix) and its
prompt length. A request is served the longest run of leading blocks that are cached, and then
all its blocks are cached. Two caches bound what any real one can do on the same sequence:
- an infinite cache: every block seen before is still there;
- the optimal cache of a given capacity (Belady's rule, exact for equal-sized blocks): when full,
  drop the block whose next use is furthest away. A block is never used later than its parent
  (every request that uses it uses the parent), and on a tie the deeper block goes first, so
  the cache never keeps a block whose prefix it dropped.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockRequest:
    keys: tuple[int, ...]  # the prompt's full blocks, in order
    prompt_tokens: int


def _served_blocks(keys: Sequence[int], cached) -> int:
    n = 0
    while n < len(keys) and keys[n] in cached:
        n += 1
    return n


def infinite_cache_share(requests: Sequence[BlockRequest], block_tokens: int) -> float:
    """The share of all prompt tokens an unbounded prefix cache serves."""
    seen: set[int] = set()
    served = 0
    for req in requests:
        served += _served_blocks(req.keys, seen) * block_tokens
        seen.update(req.keys)
    return served / max(1, sum(r.prompt_tokens for r in requests))


def _next_uses(requests: Sequence[BlockRequest]) -> list[list[float]]:
    """next_use[i][k]: the index of the next request after i that uses request i's k-th block."""
    following: dict[int, float] = {}
    out: list[list[float]] = [[] for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        keys = requests[i].keys
        out[i] = [following.get(key, math.inf) for key in keys]
        for key in keys:
            following[key] = i
    return out


def optimal_cache_share(requests: Sequence[BlockRequest], block_tokens: int, capacity_tokens: int) -> float:
    """The share of all prompt tokens the best cache holding capacity_tokens serves."""
    capacity = capacity_tokens // block_tokens
    next_use = _next_uses(requests)
    cached: dict[int, float] = {}  # key -> its next use
    heap: list[tuple[float, int, int]] = []  # (-next use, -depth, key); stale entries skipped
    served = 0
    for i, req in enumerate(requests):
        served += _served_blocks(req.keys, cached) * block_tokens
        for depth, (key, nxt) in enumerate(zip(req.keys, next_use[i])):
            cached[key] = nxt
            heapq.heappush(heap, (-nxt, -depth, key))
        while len(cached) > capacity:
            neg_next, _, key = heapq.heappop(heap)
            if cached.get(key) == -neg_next:
                del cached[key]
    return served / max(1, sum(r.prompt_tokens for r in requests))
