"""A prompt's block keys as the nodes compute them, and the scope that keys a request's blocks
apart from other requests'. The prefix index holds these keys, so placement never matches a
block another tenant or adapter computed."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from pdserve.protocol.block_keys import block_key_chain, request_salt
from pdserve.protocol.multimodal import ImageInput

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KVScope:
    """What keys a request's KV blocks apart from other requests': its salt string (a tenant's
    cache_salt, pdserve.protocol.cache_salt), its LoRA adapter, and its images (whose keys enter
    the blocks that hold their tokens). All travel to the nodes."""
    cache_salt: str | None = None
    adapter: str | None = None
    images: tuple[ImageInput, ...] = ()


NO_SCOPE = KVScope()


class BlockKeys:
    """block_keys(token_ids, scope): the keys with the salt the nodes report (node_salts: the
    distinct salts of the healthy nodes), mixed with the request's scope; `salt` (the router's
    own guess from the model config) serves only until a node reports its own, since the
    node's salt is the contract."""

    def __init__(self, block_size: int, salt: bytes | None, node_salts: Callable[[], list[bytes]]):
        self.block_size = block_size
        self.salt = salt
        self.node_salts = node_salts
        self._conflict_logged = False

    def __call__(self, token_ids: list[int], scope: KVScope = NO_SCOPE) -> list[bytes]:
        salts = self.node_salts()
        if len(salts) > 1 and not self._conflict_logged:
            self._conflict_logged = True
            log.error("nodes report %d different KV layouts (model, dtype or block size differ): "
                      "their caches cannot be shared", len(salts))
        salt = salts[0] if salts else self.salt
        if salt is None:
            return []
        return block_key_chain(token_ids, self.block_size, request_salt(salt, scope.cache_salt, scope.adapter),
                               images=scope.images)
