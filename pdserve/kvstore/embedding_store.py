"""Image embeddings in the KV store's Redis, keyed by the model's layout salt and the image's
content hash: how an encoder node hands what it encoded to the prefill node that needs it
(E/P/D, pdserve.node.encode). A value is a msgpack record of dtype, shape and raw bytes; it
expires after ttl_s, as the prefill it serves follows within seconds.
"""
from __future__ import annotations

import msgspec
import numpy as np
import torch

from pdserve.kvstore.redact import redact_url
from pdserve.kvstore.redis_cluster import REDIS_ERRORS, redis_client
from pdserve.kvstore.redis_tls import tls_options

PREFIX = b"pdserve-emb:"
class _Record(msgspec.Struct):
    dtype: str
    shape: list[int]
    data: bytes


class EmbeddingStore:
    """put/get of one image's embeddings; a Redis failure reads as a miss (the prefill node
    then encodes the image itself) and is counted."""

    def __init__(self, url: str, ttl_s: float = 600.0, socket_timeout: float = 5.0):
        self.url = redact_url(url)
        self.ttl_ms = int(ttl_s * 1000)
        self.failures = 0
        self._client = redis_client(url, socket_timeout=socket_timeout, socket_connect_timeout=2.0,
                                    **tls_options(url, None))

    @staticmethod
    def key(salt: bytes, content_hash: str) -> bytes:
        return PREFIX + salt.hex().encode() + b":" + content_hash.encode()

    def put(self, key: bytes, embeddings: torch.Tensor) -> int:
        """Stores them; the bytes written (0 on failure)."""
        array = embeddings.detach().to("cpu", torch.float32).contiguous().numpy()
        value = msgspec.msgpack.encode(_Record("float32", list(array.shape), array.tobytes()))
        try:
            self._client.set(key, value, px=self.ttl_ms)
        except REDIS_ERRORS:
            self.failures += 1
            return 0
        return len(value)

    def get(self, key: bytes) -> tuple[torch.Tensor, int] | None:
        """(the embeddings, bytes read), or None when absent, unreadable or Redis fails."""
        try:
            value = self._client.get(key)
        except REDIS_ERRORS:
            self.failures += 1
            return None
        if value is None:
            return None
        try:
            record = msgspec.msgpack.decode(value, type=_Record)
            array = np.frombuffer(record.data, dtype=record.dtype).reshape(record.shape)
        except (msgspec.DecodeError, ValueError, TypeError):
            self.failures += 1
            return None
        return torch.from_numpy(array.copy()), len(value)

    def close(self) -> None:
        self._client.close()
