"""The KV handover from a prefill node to a decode node, and the NIXL side-channel handshake.

A handover is one of two tagged structs, each carrying exactly what its transport needs: the
store's block keys, or the NIXL agent, side channel, pinned regions and lease. No handover
(None) means the decode node computes the prompt itself. The decode side picks its puller by
the handover's type (pdserve.node.pullers), the prefill side its producer by the request's
transport (pdserve.node.producers).

NIXL's own get_serialized_descs/deserialize_descs use pickle, so no NIXL object travels here:
addresses, lengths and device ids go as plain ints and the reader builds descriptors. Every
struct is msgspec msgpack; a decoder ignores fields it does not know, so a later version may add
compatibility fields, and HANDSHAKE_VERSION says when peers must agree on more than that.
"""
from __future__ import annotations

from typing import Literal

import msgspec

# Bump when the bytes a peer READs or the handshake change meaning: a peer of another version is
# refused at the handshake (its blocks are recomputed), rather than read into a scrambled cache.
HANDSHAKE_VERSION = 1

Transport = Literal["store", "nixl"]  # how a prefill node hands a prompt's KV over
Region = tuple[int, int, int]  # (address, bytes, device id) of one block


class StoreHandover(msgspec.Struct, frozen=True, tag="store"):
    """The prompt's blocks are in the shared KV store under `keys`."""
    num_tokens: int                # prompt tokens whose KV is handed over
    keys: list[bytes]              # one key per block, the last maybe a partial block's
    # Blocks before this one are not handed over: they slid out of every layer's window (a
    # model whose layers all slide). The keys stay the whole chain.
    first_block: int = 0
    # A hybrid model's recurrent state after the num_tokens tokens, stored beside the blocks
    # under block_keys.state_key(keys[-1], its layout); empty: the model has none.
    state_key: bytes = b""
    # Blocks before this one were not put by this handover: the decode node was said to hold
    # them (an earlier turn put them in the store). A decode node that lacks them fetches them
    # from the store; if they are gone it computes the prompt, whatever it does on a failed pull.
    put_from: int = 0


class NixlHandover(msgspec.Struct, frozen=True, tag="nixl"):
    """The prompt's blocks are pinned on the prefill node for a NIXL READ until the decode node
    notifies it or the lease ends (then it frees them, so a READ must not start after)."""
    num_tokens: int
    agent_name: str                # the prefill node's agent
    side_channel: str              # zmq endpoint serving the agent's metadata (NixlMetadata)
    regions: list[Region]          # per block from first_block on
    digests: list[int]             # xxh3-64 of each region's bytes, checked after the READ
    lease_s: float                 # seconds the prefill node keeps the blocks pinned
    first_block: int = 0           # as StoreHandover's; regions and digests start at it
    # A hybrid model's recurrent state after the num_tokens tokens: its pinned state slot, read
    # in the same READ as the blocks under the same lease, and its xxh3-64; None: none.
    state_region: Region | None = None
    state_digest: int = 0
    # Push mode: blocks [written_from, written_from + written) were WRITTEN already into the
    # blocks the decode node whose agent is written_to holds for this request (WriteTarget). That
    # node checks their digests and READs nothing; any other node READs as usual.
    written_to: str = ""
    written_from: int = 0
    written: int = 0

    def __post_init__(self) -> None:
        # A digest per block is the contract; catching a mismatch here beats a bad READ later.
        if self.digests and len(self.digests) != len(self.regions):
            raise ValueError(f"{len(self.digests)} digests for {len(self.regions)} regions")


KVHandover = StoreHandover | NixlHandover
# Push mode: the NIXL notification (this prefix, then the request id) by which a prefill node
# tells a decode node it WRITEs no more into that request's blocks (pdserve.node.push_writes).
WRITES_DONE_PREFIX = b"written:"


def handover_path(handover: KVHandover | None) -> str:
    """The handover's transport ("store", "nixl"), or "none" when the prompt is recomputed."""
    return "none" if handover is None else handover.__struct_config__.tag


class NixlMetadataRequest(msgspec.Struct, tag=True):
    """Decode node -> a prefill node's side channel: its agent's metadata, please."""
    version: int = HANDSHAKE_VERSION


class NixlMetadata(msgspec.Struct, tag=True):
    """One agent's NIXL metadata (the peer passes it to add_peer), with what the peer checks
    before it reads: the handshake version and the KV layout (block-key salt: model, layers,
    heads, dtype, block size; and one block's bytes). Empty/zero: not said, not checked."""
    agent_name: str
    metadata: bytes
    version: int = HANDSHAKE_VERSION
    kv_salt: bytes = b""
    block_nbytes: int = 0
    state_layout: str = ""  # a hybrid model's state slot (engine.state_pool.state_layout); "": none


def peer_mismatch(peer: NixlMetadata, kv_salt: bytes = b"", block_nbytes: int = 0,
                  state_layout: str = "") -> str | None:
    """Why this node must not READ from `peer`, or None when their handshakes agree."""
    if peer.version != HANDSHAKE_VERSION:
        return (f"NIXL peer {peer.agent_name!r} speaks handshake version {peer.version}, this node "
                f"{HANDSHAKE_VERSION}: upgrade both roles together")
    if kv_salt and peer.kv_salt and kv_salt != peer.kv_salt:
        return (f"NIXL peer {peer.agent_name!r} has another KV layout (model, dtype or block size "
                "differ): its blocks cannot be read here")
    if block_nbytes and peer.block_nbytes and block_nbytes != peer.block_nbytes:
        return f"NIXL peer {peer.agent_name!r} has {peer.block_nbytes}-byte blocks, this node {block_nbytes}"
    if peer.state_layout != state_layout:  # (both empty for attention-only models)
        return (f"NIXL peer {peer.agent_name!r} has another recurrent-state layout ({peer.state_layout or 'none'}, "
                f"this node {state_layout or 'none'}): its state cannot be read here")
    return None
