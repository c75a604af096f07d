"""Block digests kept in Redis beside a store whose values carry none (LMCache's).

The writer records each block's xxh3-64 over its first n tokens' bytes (a partial block's tail is
not part of its value) under "pdkv-digest:<key hex>"; a reader keeps only the leading loaded
blocks whose bytes match. A flipped byte ends the run there and is counted in `failures`, so the
caller computes the rest; a missing digest (or Redis unreachable) counts as a miss, never as
trusted bytes. Digests this process wrote or fetched are also kept locally (bounded LRU), so the
blocks in its own CPU tier stay usable while Redis is down.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import torch
import xxhash

from pdserve.kvstore.redis_cluster import REDIS_ERRORS, mget, mset, redis_client

log = logging.getLogger(__name__)
DIGEST_PREFIX = b"pdkv-digest:"
MAX_KNOWN = 1 << 18


def token_digests(kv_cache: torch.Tensor, block_ids: Sequence[int], num_tokens: Sequence[int]) -> list[bytes]:
    out = []
    for b, n in zip(block_ids, num_tokens):
        block = kv_cache[int(b), :, :, :n].detach().cpu().contiguous()
        out.append(xxhash.xxh3_64_digest(block.reshape(-1).view(torch.uint8).numpy()))
    return out


class DigestLedger:
    def __init__(self, redis_url: str):
        self.client = redis_client(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.failures = 0
        self.known: OrderedDict[bytes, bytes] = OrderedDict()  # block key -> digest

    def _remember(self, keys: Sequence[bytes], digests: Sequence[bytes | None]) -> None:
        for key, digest in zip(keys, digests):
            if digest is not None:
                self.known[key] = digest
                self.known.move_to_end(key)
        while len(self.known) > MAX_KNOWN:
            self.known.popitem(last=False)

    def _expected(self, keys: Sequence[bytes]) -> list[bytes | None]:
        unknown = [k for k in keys if k not in self.known]
        if unknown:
            try:
                self._remember(unknown, mget(self.client, self._names(unknown)))
            except REDIS_ERRORS as exc:
                log.warning("could not read %d block digests, treating them as missing: %s", len(unknown), exc)
        return [self.known.get(k) for k in keys]

    @staticmethod
    def _names(keys: Sequence[bytes]) -> list[bytes]:
        return [DIGEST_PREFIX + k.hex().encode() for k in keys]

    def put(self, keys: Sequence[bytes], kv_cache: torch.Tensor, block_ids: Sequence[int],
            num_tokens: Sequence[int]) -> bool:
        """Record the blocks' digests; False if Redis could not be written (it is down)."""
        if not keys:
            return True
        digests = token_digests(kv_cache, block_ids, num_tokens)
        self._remember(keys, digests)
        try:
            mset(self.client, dict(zip(self._names(keys), digests)))
        except REDIS_ERRORS as exc:  # readers then find no digest and compute those blocks
            log.warning("could not write %d block digests: %s", len(keys), exc)
            return False
        return True

    def verified(self, keys: Sequence[bytes], kv_cache: torch.Tensor, block_ids: Sequence[int],
                 num_tokens: Sequence[int]) -> int:
        """How many leading blocks (already loaded into kv_cache) match their writer's digest."""
        if not keys:
            return 0
        expected = self._expected(keys)
        for i, (want, got) in enumerate(zip(expected, token_digests(kv_cache, block_ids, num_tokens))):
            if want != got:
                if want is not None:
                    self.failures += 1
                    log.warning("block %d of %d failed its digest check: computing from there", i, len(keys))
                return i
        return len(keys)

    def close(self) -> None:
        self.client.close()
