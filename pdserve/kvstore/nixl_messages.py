"""Side-channel messages for NIXL KV hand-off between a prefill node and a decode node.

Everything here is plain data encoded with msgspec msgpack and decoded with typed decoders.
NIXL's own get_serialized_descs/deserialize_descs use pickle, so we never send NIXL objects:
addresses, lengths and device ids travel as plain ints and the receiver builds descriptors.
"""
from __future__ import annotations

import msgspec


class NixlPeerInfo(msgspec.Struct, frozen=True, tag=True):
    """One agent's NIXL metadata, sent once per peer (the peer passes it to add_peer)."""

    agent_name: str
    metadata: bytes


class NixlBlockRegions(msgspec.Struct, frozen=True, tag=True):
    """Where a request's pinned KV blocks live on the prefill node.

    regions[i] is (addr, nbytes, dev_id) of the i-th block, in the request's block order;
    digests[i] is the xxh3_64 of that block's bytes (see nixl_transfer.block_digest), taken
    when the blocks were pinned so the reader can detect a block reused after its lease.
    lease_expires_at is Unix time (time.time()): the prefill node frees the blocks then even
    without a completion notification, so a reader must not start a READ after it.
    """

    request_id: str
    agent_name: str
    regions: list[tuple[int, int, int]]
    digests: list[int]
    lease_expires_at: float

    def __post_init__(self) -> None:
        # A digest per block is the contract; catching a mismatch here beats a bad READ later.
        if self.digests and len(self.digests) != len(self.regions):
            raise ValueError(
                f"{len(self.digests)} digests for {len(self.regions)} regions"
            )


NixlMessage = NixlPeerInfo | NixlBlockRegions

_encoder = msgspec.msgpack.Encoder()
_peer_decoder = msgspec.msgpack.Decoder(NixlPeerInfo)
_regions_decoder = msgspec.msgpack.Decoder(NixlBlockRegions)
_any_decoder = msgspec.msgpack.Decoder(NixlMessage)


def encode_message(msg: NixlMessage) -> bytes:
    """msgpack bytes for either message type (tagged, so decode_message can tell them apart)."""
    return _encoder.encode(msg)


def decode_peer_info(buf: bytes) -> NixlPeerInfo:
    return _peer_decoder.decode(buf)


def decode_block_regions(buf: bytes) -> NixlBlockRegions:
    return _regions_decoder.decode(buf)


def decode_message(buf: bytes) -> NixlMessage:
    """Decode either message from a socket that carries both."""
    return _any_decoder.decode(buf)
