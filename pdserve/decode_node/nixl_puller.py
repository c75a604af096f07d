"""The decode side of a NIXL handover: fetch the prefill agent's metadata over its zmq side
channel once, READ the blocks, then check lease and digests before trusting them."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
import zmq

from pdserve.kvstore.nixl_transfer import NixlKVAgent, NixlReadHandle, NixlTransferError, mismatched_blocks
from pdserve.wire.messages import KVHandover, NixlMetadata, NixlMetadataRequest, decode, encode

log = logging.getLogger(__name__)
METADATA_TIMEOUT_MS = 3000
LEASE_MARGIN_S = 0.25  # a READ must finish this long before the lease ends to be trusted
# Fault injection for tests: the first N pulls that land get one byte flipped in their first
# block before the digest check, as a flaky link or bad DIMM would.
CORRUPT_PULLS_ENV = "PDSERVE_FAULT_CORRUPT_NIXL_PULLS"


@dataclass
class Pull:
    handle: NixlReadHandle
    handover: KVHandover
    local_ids: list[int]
    first: int
    lease_end: float


class NixlPuller:
    def __init__(self, name: str, kv_cache, ctx: zmq.Context):
        self.agent = NixlKVAgent(name, kv_cache)
        self.kv_cache = kv_cache
        self.ctx = ctx
        self.peers: dict[str, str] = {}  # side channel -> agent name
        self.pulls: dict[str, Pull] = {}
        self.integrity_failures = 0  # pulls whose blocks failed their digest check
        self._corrupt_left = int(os.environ.get(CORRUPT_PULLS_ENV, "0") or 0)

    def _peer(self, side_channel: str, agent_name: str = "") -> str:
        if side_channel not in self.peers:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(side_channel)
            try:
                sock.send(encode(NixlMetadataRequest()))
                if not sock.poll(METADATA_TIMEOUT_MS):
                    raise NixlTransferError(f"no NIXL metadata from {side_channel}")
                reply = decode(sock.recv())
            finally:
                sock.close(0)
            if not isinstance(reply, NixlMetadata):
                raise NixlTransferError(f"unexpected side-channel reply {type(reply).__name__}")
            name = self.agent.add_peer(reply.metadata, agent_name)
            self.agent.make_connection(name)
            self.peers[side_channel] = name
        return self.peers[side_channel]

    def start(self, rid: str, handover: KVHandover, local_ids: list[int], first: int,
              received_at: float, timeout_s: float) -> bool:
        """Post the READ of blocks [first:] of the prompt (local_ids: the prompt's local blocks;
        the handover's regions start at its first_block); False if it cannot start."""
        # The lease runs from when we received the handover (our clock, so no skew between
        # machines); it started a little earlier on the prefill node, which the margin covers.
        lease_end = received_at + handover.lease_s
        if time.monotonic() > lease_end - LEASE_MARGIN_S:
            log.warning("[%s] the lease has expired before the READ: recomputing", rid)
            return False
        try:
            peer = self._peer(handover.side_channel, handover.agent_name)
            regions = handover.regions[first - handover.first_block:]
            handle = self.agent.start_read(peer, regions, local_ids[first:], notif=rid.encode(),
                                           timeout_s=max(min(lease_end - LEASE_MARGIN_S - time.monotonic(),
                                                             timeout_s), 0.1))
        except (NixlTransferError, ValueError, IndexError) as exc:
            log.warning("[%s] NIXL READ not started: %s", rid, exc)
            self.peers.pop(handover.side_channel, None)
            return False
        self.pulls[rid] = Pull(handle, handover, local_ids, first, lease_end)
        return True

    def poll(self) -> list[tuple[str, bool]]:
        """(request id, arrived whole) for each READ that ended since the last call."""
        done = []
        for rid, pull in list(self.pulls.items()):
            state = self.agent.poll(pull.handle)
            if state == "PROC":
                continue
            del self.pulls[rid]
            done.append((rid, state == "DONE" and self._trusted(rid, pull)))
        return done

    def _trusted(self, rid: str, pull: Pull) -> bool:
        if time.monotonic() > pull.lease_end - LEASE_MARGIN_S:
            log.warning("[%s] READ ended after the lease: the blocks may have been reused", rid)
            return False
        ids = pull.local_ids[pull.first:]
        if self._corrupt_left > 0 and ids:
            self._corrupt_left -= 1
            self.kv_cache[ids[0]].view(-1).view(torch.uint8)[7] ^= 0x10
        bad = mismatched_blocks(self.kv_cache, ids, pull.handover.digests[pull.first - pull.handover.first_block:])
        if bad:
            self.integrity_failures += 1
            log.warning("[%s] %d blocks failed their digest check", rid, len(bad))
        return not bad

    def release_remote(self, handover: KVHandover, rid: str) -> None:
        """Tell the prefill node to free blocks we will not read."""
        try:
            self.agent.send_notification(self._peer(handover.side_channel), rid.encode())
        except NixlTransferError as exc:
            log.debug("[%s] could not notify the prefill node (its lease will free them): %s", rid, exc)

    def in_flight(self, rid: str) -> bool:
        return rid in self.pulls

    def close(self) -> None:
        self.agent.close()
