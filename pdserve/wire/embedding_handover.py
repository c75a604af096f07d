"""One image's embeddings handed from an encoder node to the node that needs them, over NIXL
(E/P/D; pdserve.kvstore.embedding_nixl): where they sit in the encoder node's arena and what the
reader checks. The router takes it from the EncodeResult into the PrefillRequest. As with KV
handovers (pdserve.wire.handover), no NIXL object travels: regions are plain ints, and the
reader fetches the encoder agent's metadata from side_channel (a NixlMetadataRequest) once.
"""
from __future__ import annotations

import msgspec

Region = tuple[int, int, int]  # (address, bytes, device id) of one arena block


class EmbeddingHandover(msgspec.Struct, frozen=True):
    content_hash: str      # the image's (ImageInput.content_hash)
    rows: int              # embeddings (one per placeholder token)
    agent_name: str        # the encoder node's embedding agent
    side_channel: str      # zmq endpoint serving that agent's metadata
    regions: list[Region]  # the arena blocks holding the rows, in order, the last one padded
    digests: list[int]     # xxh3-64 of each block's bytes, checked after the READ
    lease_id: str          # the reader's notification: the encoder node unpins the blocks
    lease_s: float         # seconds the encoder node keeps the blocks pinned without one
