"""Where a handover is pulled: the decode node's one interface over both transports.

A puller starts a pull of a prompt's blocks into the request's local blocks, reports each pull
that ended (and whether its bytes arrived whole) when polled, and tells a sender it will not read
what it was handed. The decode node picks the puller once, by the handover's type.
- StorePuller: fetches the blocks from the shared KV store on a worker thread.
- NixlPuller: fetches the prefill agent's metadata over its zmq side channel once (refusing a
  peer whose handshake does not match), READs the blocks, then checks lease and digests.
For a hybrid model each pull also lands the recurrent state after the handed-over tokens in the
request's state slot (pdserve.engine.state_pool): from the store under its state key, or in the
same READ as the blocks, with its own digest. A pull whose state does not arrive has failed.

A node restarted on the same addresses is a new peer: each process names its NIXL agent anew
(agent_instance_name), so a handover from the new process names another agent than the one a
decode node loaded, which then drops the old agent and handshakes again. A READ that fails drops
its peer too. Without this, a decode node READs the new process's blocks through the dead one's
registrations: every READ fails, and the blocks it never read stay pinned until their lease.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch
import zmq

from pdserve.engine.state_pool import StatePool
from pdserve.kvstore.base import KVStore
from pdserve.kvstore.block_digest import block_digest, mismatched_blocks
from pdserve.kvstore.errors import KVStoreError
from pdserve.kvstore.nixl_transfer import (
    NixlKVAgent,
    NixlReadHandle,
    NixlTransferError,
)
from pdserve.protocol.block_keys import state_key
from pdserve.wire.handover import (
    WRITES_DONE_PREFIX,
    KVHandover,
    NixlHandover,
    NixlMetadata,
    NixlMetadataRequest,
    StoreHandover,
    peer_mismatch,
)
from pdserve.wire.messages import WriteTarget, decode, encode

log = logging.getLogger(__name__)
METADATA_TIMEOUT_MS = 3000
LEASE_MARGIN_S = 0.25  # a READ must finish this long before the lease ends to be trusted
# Fault injection for tests: the first N pulls that land get one byte flipped in their first
# block before the digest check, as a flaky link or bad DIMM would.
CORRUPT_PULLS_ENV = "PDSERVE_FAULT_CORRUPT_NIXL_PULLS"


class Puller(Protocol):
    handover_type: type  # the handovers it pulls
    path: str  # the transport, naming its transfer_bytes_<path> / transfer_us_<path> counters

    def start(self, rid: str, handover: KVHandover, local_ids: list[int], first: int,
              received_at: float, timeout_s: float, slot: int | None = None) -> bool:
        """Start pulling blocks [first:] of the prompt into local_ids[first:] (local_ids: the
        prompt's local blocks), and a hybrid model's state into state slot `slot`; False if the
        pull cannot start."""

    def poll(self) -> list[tuple[str, bool]]:
        """(request id, arrived whole) for each pull that ended since the last call."""

    def release(self, handover: KVHandover, rid: str) -> None:
        """Tell the sender we will not read these blocks."""

    def close(self) -> None: ...


class StorePuller:
    handover_type = StoreHandover
    path = "store"

    def __init__(self, store: KVStore, kv_cache: torch.Tensor, block_size: int, states: StatePool | None = None):
        self.store = store
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.states = states
        self.fetcher = ThreadPoolExecutor(1, thread_name_prefix="kv-fetch")
        self.fetches: dict[str, Future] = {}

    def start(self, rid: str, handover: StoreHandover, local_ids: list[int], first: int,
              received_at: float, timeout_s: float, slot: int | None = None) -> bool:
        bs, n = self.block_size, len(local_ids)
        if self.states is not None and handover.state_key != state_key(handover.keys[-1], self.states.layout):
            log.warning("[%s] the handover's recurrent state is not this node's layout (or absent)", rid)
            return False  # (hashes are the contract: another layout keys its state elsewhere)
        counts = [min(bs, handover.num_tokens - i * bs) for i in range(first, n)]
        state = None if self.states is None else (handover.state_key, slot)
        self.fetches[rid] = self.fetcher.submit(self._fetch, handover.keys[first:n], local_ids[first:], counts, first,
                                                state)
        return True

    def _fetch(self, keys: list[bytes], block_ids: list[int], counts: list[int], first: int,
               state: tuple[bytes, int] | None) -> bool:
        try:
            if keys and self.store.get(keys, self.kv_cache, block_ids, counts, first_block=first) != len(keys):
                return False
            return state is None or self.store.get_state(state[0], self.states.arena, state[1])
        except KVStoreError as exc:
            log.warning("store fetch failed: %s", exc)
            return False

    def poll(self) -> list[tuple[str, bool]]:
        return [(rid, self.fetches.pop(rid).result()) for rid in [r for r, f in self.fetches.items() if f.done()]]

    def release(self, handover: StoreHandover, rid: str) -> None:
        """The store keeps its blocks whether or not they are read."""

    def close(self) -> None:
        self.fetcher.shutdown(wait=True, cancel_futures=True)


@dataclass
class Read:
    handle: NixlReadHandle
    handover: NixlHandover
    local_ids: list[int]
    first: int
    lease_end: float
    slot: int | None = None  # a hybrid model's state slot, READ with the blocks


def fetch_peer_metadata(ctx: zmq.Context, side_channel: str, kv_salt: bytes = b"",
                        block_nbytes: int = 0, state_layout: str = "") -> NixlMetadata:
    """The handshake: ask a prefill node's side channel for its agent's metadata, and refuse a
    peer whose version or KV layout differs from ours (NixlTransferError)."""
    sock = ctx.socket(zmq.DEALER)
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
    if (why := peer_mismatch(reply, kv_salt, block_nbytes, state_layout)) is not None:
        raise NixlTransferError(why)
    return reply


def agent_instance_name(node_id: str) -> str:
    """A NIXL agent name for this process: the node id, and what tells its restarts apart."""
    return f"{node_id}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


class NixlPuller:
    handover_type = NixlHandover
    path = "nixl"

    def __init__(self, name: str, kv_cache: torch.Tensor, ctx: zmq.Context, kv_salt: bytes = b"",
                 states: StatePool | None = None):
        self.states = states
        self.agent = NixlKVAgent(agent_instance_name(name), kv_cache, state_arena=states.arena if states else None)
        self.kv_cache = kv_cache
        self.ctx = ctx
        self.kv_salt = kv_salt
        self.peers: dict[str, str] = {}  # side channel -> agent name
        self.reads: dict[str, Read] = {}
        self.integrity_failures = 0  # pulls whose blocks failed their digest check
        self._corrupt_left = int(os.environ.get(CORRUPT_PULLS_ENV, "0") or 0)
        self.written: set[str] = set()  # push mode: pulls whose blocks a prefill node WROTE (nothing READ)
        self._landed: list[str] = []  # ... reported by the next poll()
        self._metadata: NixlMetadata | None = None

    def write_target(self, rid: str, block_ids: list[int], first: int, lease_s: float,
                     lend_from: int | None = None) -> WriteTarget:
        """Where a push-mode request's prefill node may WRITE blocks [first:] of its prompt
        (block_ids: the prompt's local blocks), with this agent's handshake; and blocks
        [lend_from, first), which this node holds, lent for a READ with their digests."""
        if self._metadata is None:
            self._metadata = NixlMetadata(self.agent.name, self.agent.metadata(), kv_salt=self.kv_salt,
                                          block_nbytes=self.agent.block_nbytes)
        lent = block_ids[first if lend_from is None else lend_from:first]
        return WriteTarget(rid, self._metadata, first, self.agent.block_regions(block_ids[first:]), lease_s,
                           held_from=first - len(lent), held=self.agent.block_regions(lent),
                           held_digests=block_digest(self.kv_cache, lent) if lent else [])

    def writes_done(self) -> list[str]:
        """Requests whose prefill nodes said they write no more into their blocks."""
        notes = self.agent.get_notifications()
        done = len(WRITES_DONE_PREFIX)
        return [note[done:].decode(errors="replace") for _, note in notes if note.startswith(WRITES_DONE_PREFIX)]

    def _landed_by_write(self, rid: str, handover: NixlHandover, local_ids: list[int], first: int) -> bool:
        """The prefill node WROTE blocks [first:] here (push mode) and they hash to its digests."""
        if handover.written_to != self.agent.name or handover.state_region is not None:
            return False
        if not handover.written_from <= first or handover.written_from + handover.written < len(local_ids):
            return False
        ids = local_ids[first:]
        if self._corrupt_left > 0 and ids:
            self._corrupt_left -= 1
            self.kv_cache[ids[0]].view(-1).view(torch.uint8)[7] ^= 0x10
        if mismatched_blocks(self.kv_cache, ids, handover.digests[first - handover.first_block:]):
            self.integrity_failures += 1
            log.warning("[%s] written blocks failed their digest check: READing them", rid)
            return False
        return True

    def _peer(self, side_channel: str, agent_name: str) -> str:
        """The loaded agent serving `side_channel`, which must be the handover's `agent_name`."""
        if self.peers.get(side_channel, agent_name) != agent_name:
            log.info("NIXL peer at %s is a new process (%s): dropping its old agent", side_channel, agent_name)
            self.forget_peer(side_channel)
        if side_channel not in self.peers:
            reply = fetch_peer_metadata(self.ctx, side_channel, self.kv_salt, self.agent.block_nbytes,
                                        self.states.layout if self.states is not None else "")
            if reply.agent_name != agent_name:  # the handover's process is gone; another serves there
                raise NixlTransferError(f"agent {agent_name} no longer serves {side_channel}")
            name = self.agent.add_peer(reply.metadata, agent_name)
            self.agent.make_connection(name)
            self.peers[side_channel] = name
        return self.peers[side_channel]

    def forget_peer(self, side_channel: str) -> None:
        """Unload the agent at `side_channel`: the next handover from there handshakes again."""
        name = self.peers.pop(side_channel, None)
        if name is not None:
            self.agent.remove_peer(name)

    def start(self, rid: str, handover: NixlHandover, local_ids: list[int], first: int,
              received_at: float, timeout_s: float, slot: int | None = None) -> bool:
        """Post the READ (the handover's regions start at its first_block; a hybrid model's
        state slot in the same READ)."""
        # The lease runs from when we received the handover (our clock, so no skew between
        # machines); it started a little earlier on the prefill node, which the margin covers.
        lease_end = received_at + handover.lease_s
        if time.monotonic() > lease_end - LEASE_MARGIN_S:
            log.warning("[%s] the lease has expired before the READ: recomputing", rid)
            return False
        if (self.states is None) != (handover.state_region is None):
            log.warning("[%s] the handover's recurrent state does not match this model: recomputing", rid)
            return False
        if self._landed_by_write(rid, handover, local_ids, first):
            self.written.add(rid)
            self._landed.append(rid)
            self.release(handover, rid)  # the prefill node may free its pinned blocks
            return True
        try:
            peer = self._peer(handover.side_channel, handover.agent_name)
            regions = handover.regions[first - handover.first_block:]
            state = None if handover.state_region is None else (handover.state_region, slot)
            handle = self.agent.start_read(peer, regions, local_ids[first:], notif=rid.encode(),
                                           timeout_s=max(min(lease_end - LEASE_MARGIN_S - time.monotonic(),
                                                             timeout_s), 0.1), state=state)
        except (NixlTransferError, ValueError, IndexError) as exc:
            log.warning("[%s] NIXL READ not started: %s", rid, exc)
            self.forget_peer(handover.side_channel)
            return False
        self.reads[rid] = Read(handle, handover, local_ids, first, lease_end, slot)
        return True

    def poll(self) -> list[tuple[str, bool]]:
        done = [(rid, True) for rid in self._landed]
        self._landed.clear()
        for rid, read in list(self.reads.items()):
            state = self.agent.poll(read.handle)
            if state == "PROC":
                continue
            del self.reads[rid]
            if state != "DONE":  # a peer that fails a READ may be gone or restarted: handshake anew
                self.forget_peer(read.handover.side_channel)
            done.append((rid, state == "DONE" and self._trusted(rid, read)))
        return done

    def _trusted(self, rid: str, read: Read) -> bool:
        if time.monotonic() > read.lease_end - LEASE_MARGIN_S:
            log.warning("[%s] READ ended after the lease: the blocks may have been reused", rid)
            return False
        ids = read.local_ids[read.first:]
        if self._corrupt_left > 0 and ids:
            self._corrupt_left -= 1
            self.kv_cache[ids[0]].view(-1).view(torch.uint8)[7] ^= 0x10
        bad = mismatched_blocks(self.kv_cache, ids, read.handover.digests[read.first - read.handover.first_block:])
        if read.slot is not None and block_digest(self.states.arena, [read.slot]) != [read.handover.state_digest]:
            bad.append(-1)  # the state slot
        if bad:
            self.integrity_failures += 1
            log.warning("[%s] %d blocks failed their digest check", rid, len(bad))
        return not bad

    def release(self, handover: NixlHandover, rid: str) -> None:
        """Tell the prefill node to free blocks we will not read."""
        try:
            self.agent.send_notification(self._peer(handover.side_channel, handover.agent_name), rid.encode())
        except NixlTransferError as exc:
            log.debug("[%s] could not notify the prefill node (its lease will free them): %s", rid, exc)

    def close(self) -> None:
        self.agent.close()
