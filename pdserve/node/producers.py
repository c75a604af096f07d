"""Where a handover is made: the prefill node's one producer per transport.

Once a prompt is computed, the producer of the transport the request names describes where its
KV is (pdserve.wire.handover):
- StoreProducer writes the blocks to the shared KV store (off the node's loop: node/store_puts.py);
  the node frees them once the put ends.
- NixlProducer pins them for the decode node's READ and serves its agent's metadata on a zmq side
  channel; it frees them on the decode node's notification, or when their lease ends.
A hybrid model's request also holds a state slot (pdserve.engine.state_pool) with the recurrent
state after its prompt: it travels with the blocks, held with them and freed with them: stored
under the state key of the prompt's last block (with the snapshots this node took at the
prompt's block boundaries, for other nodes' prefix hits), or pinned and READ with the blocks.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Protocol

import torch
import zmq

from pdserve.engine.engine import LLMEngine
from pdserve.kvstore.base import KVStore
from pdserve.kvstore.block_digest import block_digest
from pdserve.kvstore.errors import KVStoreError
from pdserve.kvstore.nixl_transfer import NixlKVAgent
from pdserve.node.metadata_server import MetadataServer
from pdserve.node.node_stats import NodeStats
from pdserve.node.pullers import agent_instance_name
from pdserve.protocol.block_keys import state_key
from pdserve.wire.handover import KVHandover, NixlHandover, NixlMetadata, StoreHandover, Transport
from pdserve.wire.messages import PrefillRequest
from pdserve.wire.transport import NodeSocket

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PendingPrefill:
    identity: bytes
    request: PrefillRequest
    keys: list[bytes]  # the prompt's block-key chain, its trailing partial block included
    store_tokens: int = 0  # prompt tokens the store held at admission


def decode_held_blocks(engine: LLMEngine, request: PrefillRequest) -> int:
    """Leading whole blocks of the prompt the decode node holds already (the router says how
    many tokens: an earlier turn of the conversation). A store handover does not write them
    again: that node reads none of them, and any other finds them in the store, where the
    earlier turn put them. A hybrid model's are all written (its state snapshots go with them)."""
    if engine.kv.states is not None:
        return 0
    return min(request.decode_holds_tokens, len(request.prompt_token_ids) - 1) // engine.config.block_size


@dataclasses.dataclass
class StoreJob:
    """A store handover's put: the request, its blocks' ids (held until the put ends), the
    first block in the attention window and the blocks the decode node holds (decode_held_blocks)."""
    pending: PendingPrefill
    block_ids: list[int]
    first_block: int
    state_slot: int | None = None  # a hybrid model's: the state after the prompt
    # (chain position, copy of the state) at the prompt's block boundaries this node snapshotted
    snapshots: list[tuple[int, torch.Tensor]] = dataclasses.field(default_factory=list)
    decode_held: int = 0  # leading blocks the decode node holds: not written again


class Producer(Protocol):
    transport: Transport
    pins_blocks: bool  # the request's blocks stay held after the handover, until freed()

    def hand_over(self, pending: PendingPrefill) -> KVHandover:
        """Describe (and, for the store, write) the prompt's KV; raises KVStoreError or
        RuntimeError when it cannot."""

    def freed(self) -> list[str]:
        """Requests whose pinned blocks may be freed now."""

    def forget(self, request_id: str) -> None:
        """The request was aborted: its blocks are freed with it."""

    def idle(self) -> bool: ...

    def close(self) -> None: ...


# Why a node cannot serve a transport it has no producer for.
MISSING = {"nixl": "this prefill node has no NIXL agent (start it with --nixl-side-channel)",
           "store": "this prefill node has no KV store (start it with --store)"}


def advertised(endpoint: str, host: str | None) -> str:
    if not host:
        return endpoint
    scheme, rest = endpoint.split("://", 1)
    return f"{scheme}://{host}:{rest.rsplit(':', 1)[1]}"


class StoreProducer:
    transport = "store"
    pins_blocks = False

    def __init__(self, engine: LLMEngine, store: KVStore, stats: NodeStats):
        self.engine, self.store, self.stats = engine, store, stats

    def hand_over(self, pending: PendingPrefill) -> StoreHandover:
        return self.write(self.prepare(pending))

    def prepare(self, pending: PendingPrefill) -> StoreJob:
        """What write() needs of the engine, read on the node's loop (the scheduler is not
        thread-safe); write() may then run on another thread while the request holds its blocks."""
        held = self.engine.scheduler.held[pending.request.request_id]
        snaps, full = self.engine.kv.snapshots, len(pending.request.prompt_token_ids) // self.engine.config.block_size
        taken = [] if snaps is None else [(i, snaps.get(k)) for i, k in enumerate(pending.keys[:full]) if k in snaps]
        return StoreJob(pending, list(held.block_ids[:len(pending.keys)]), held.num_slid_blocks, held.state_slot,
                        taken, decode_held_blocks(self.engine, pending.request))

    def write(self, job: StoreJob) -> StoreHandover:
        """Put the prompt's blocks in the store; raises KVStoreError or RuntimeError."""
        pending, first = job.pending, job.first_block  # the decode node reads only the blocks in the window
        req, keys = pending.request, pending.keys
        prompt, bs = req.prompt_token_ids, self.engine.config.block_size
        t0 = time.perf_counter()
        # A prefix the shared store already holds (a warm prompt) is not written again: on a
        # 2048-token prefix that rewrite was most of the handover, and it sat before the first token.
        # Nor is what the decode node holds (a conversation's earlier turns).
        start = max(first, job.decode_held, self._shared_blocks(pending))
        counts = [min(bs, len(prompt) - i * bs) for i in range(start, len(keys))]
        self.store.put(keys[start:], self.engine.kv_cache, job.block_ids[start:], counts, first_block=start)
        key = self._put_states(job, start)
        self.stats.transfer_us_store += int((time.perf_counter() - t0) * 1e6)
        self.stats.transfer_bytes_store += len(counts) * self.engine.kv_cache[0].numel() * self.engine.kv_cache.element_size()
        log.debug("[%s] stored %d blocks (from block %d) in %.1f ms", req.request_id, len(counts), start,
                  (time.perf_counter() - t0) * 1e3)
        return StoreHandover(len(prompt), keys, first_block=first, state_key=key, put_from=job.decode_held)

    def _put_states(self, job: StoreJob, start: int) -> bytes:
        """A hybrid model's state after the prompt, and the snapshots at its boundaries past the
        shared prefix, each under the state key of its block; the handover's state key."""
        states = self.engine.kv.states
        if states is None:
            return b""
        puts, last = 1, len(job.pending.keys) - 1
        for i, row in job.snapshots:
            # (a prompt ending on a boundary has a snapshot under its last key: the state put below)
            if start <= i < last:
                self.store.put_state(state_key(job.pending.keys[i], states.layout), row.view(1, -1), 0)
                puts += 1
        key = state_key(job.pending.keys[-1], states.layout)
        self.store.put_state(key, states.arena, job.state_slot)
        self.stats.transfer_bytes_store += puts * states.slot_nbytes  # each a whole slot, as the blocks' bytes
        return key

    def _shared_blocks(self, pending: PendingPrefill) -> int:
        """Leading blocks of the prompt every decode node can read from the store already. Asked
        again at handover (one round trip) only when admission found a prefix there."""
        if not pending.store_tokens:
            return 0
        full = len(pending.request.prompt_token_ids) // self.engine.config.block_size
        try:
            return self.store.shared_prefix(pending.keys[:full])
        except KVStoreError:
            return 0

    def freed(self) -> list[str]:
        return []

    def forget(self, request_id: str) -> None:
        pass

    def idle(self) -> bool:
        return True

    def close(self) -> None:
        """The store is the node's, not the producer's: the node closes it."""


class NixlProducer:
    transport = "nixl"
    pins_blocks = True

    def __init__(self, engine: LLMEngine, node_id: str, ctx: zmq.Context, side_channel: str,
                 advertise_host: str | None, lease_s: float, stats: NodeStats):
        self.engine, self.lease_s, self.stats = engine, lease_s, stats
        states = engine.kv.states  # a hybrid model's state slots are READ with the blocks
        self.agent = NixlKVAgent(agent_instance_name(node_id), engine.kv_cache,  # new each process
                                 state_arena=None if states is None else states.arena)
        side = NodeSocket(ctx, side_channel)  # bound now: a taken port fails the node's start
        # Bound on e.g. tcp://0.0.0.0:5701; decode nodes must dial a name they can reach.
        self.side_channel = advertised(side_channel, advertise_host)
        self.leases: dict[str, float] = {}  # request id -> monotonic expiry of its pinned blocks
        self.side = MetadataServer(side, self.metadata())  # the handshake, off the node's loop

    def metadata(self) -> NixlMetadata:
        """The handshake's answer: the agent, and what a reader checks before it READs."""
        states = self.engine.kv.states
        return NixlMetadata(self.agent.name, self.agent.metadata(), kv_salt=self.engine.salt,
                            block_nbytes=self.agent.block_nbytes, state_layout=states.layout if states else "")

    def hand_over(self, pending: PendingPrefill) -> NixlHandover:
        req = pending.request
        prompt, bs = req.prompt_token_ids, self.engine.config.block_size
        held = self.engine.scheduler.held[req.request_id]
        first = held.num_slid_blocks  # the decode node reads only the blocks in the window
        ids = held.block_ids[first:-(-len(prompt) // bs)]
        self.leases[req.request_id] = time.monotonic() + self.lease_s
        state = {}
        if (states := self.engine.kv.states) is not None:  # pinned with the blocks, under their lease
            state = dict(state_region=self.agent.slot_region(held.state_slot),
                         state_digest=block_digest(states.arena, [held.state_slot])[0])
        return NixlHandover(len(prompt), self.agent.name, self.side_channel, self.agent.block_regions(ids),
                            block_digest(self.engine.kv_cache, ids), self.lease_s, first_block=first, **state)

    def freed(self) -> list[str]:
        done = []
        for _peer, note in self.agent.get_notifications():
            rid = note.decode(errors="replace")
            if self.leases.pop(rid, None) is not None:
                done.append(rid)
                self.stats.transfers_ok += 1
        now = time.monotonic()
        for rid in [r for r, expiry in self.leases.items() if expiry <= now]:
            del self.leases[rid]
            done.append(rid)
            self.stats.leases_expired += 1
            log.info("[%s] lease expired: pinned blocks freed", rid)
        return done

    def forget(self, request_id: str) -> None:
        self.leases.pop(request_id, None)

    def idle(self) -> bool:
        return not self.leases

    def close(self) -> None:
        self.side.close()
        self.agent.close()
