"""A prefill node's push-mode WRITEs (`--handover push` over NIXL): the prompt's blocks go into the
decode node's blocks as the chunks that compute them complete, not pulled after the first token.

The decode node admits a push-mode request with its blocks allocated and names them in a
WriteTarget, which the router forwards here. Between engine steps, every whole block the request
has computed since the last step is WRITTEN into its block there; the rest (the trailing blocks,
the partial one included) go when the first token is out, before the handover is sent. The
handover is pull mode's (pinned blocks, digests, lease) plus what was written
(NixlHandover.written_to/written_from/written): the decode node checks the written blocks'
digests and READs nothing, and a decode node that fails meanwhile leaves the handover to another
node, which READs as in pull mode.

No WRITE is posted once the target's lease has passed since it came (the decode node holds an
aborted request's blocks until then, or until the "done" notification sent here when this node
stops writing for the request), and a WRITE that fails stops the writes to that target.

Layer-wise streaming (layer_groups > 0): during a step, each group of layers' slice of the blocks
the step fills (the block-major cache holds a block's layers one after another) is WRITTEN as
soon as the last layer of the group has stored its KV, while the later layers compute; a step
whose every group went needs no write after it, and the last chunk's blocks, the partial one
included, are in place when the first token is drawn. A step whose layers did not all report
in order (AttentionContext.layer_stored; a tensor- or pipeline-parallel runner's steps do not)
is written after it, whole blocks, as without streaming.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import msgspec

from pdserve.engine.engine import LLMEngine
from pdserve.kvstore.nixl_transfer import NixlKVAgent, NixlTransferError
from pdserve.node.node_stats import NodeStats
from pdserve.wire.handover import WRITES_DONE_PREFIX, NixlHandover, Region, peer_mismatch
from pdserve.wire.messages import WriteTarget

log = logging.getLogger(__name__)
WRITE_TIMEOUT_S = 0.5  # a WRITE runs on the node's loop thread (over cma: inside the post itself)


@dataclasses.dataclass
class Target:
    peer: str               # the decode node's agent, loaded
    first_block: int        # regions[i] is prompt block first_block + i
    regions: list[Region]
    lease_end: float        # no WRITE is posted after this (monotonic, this node's clock)
    upto: int               # blocks [first_block, upto) are written
    broken: bool = False    # a WRITE failed or the lease passed: nothing more is written


@dataclasses.dataclass
class StreamedBlocks:
    """One request's blocks that a step fills, written a group of layers at a time."""
    target: Target
    rid: str
    first: int              # prompt block index of block_ids[0]
    end: int                # ... one past the last
    block_ids: list[int]


def layer_group_spans(num_layers: int, groups: int) -> dict[int, tuple[int, int]]:
    """Up to `groups` runs of layers of near-equal length, [start, end) keyed by each one's last layer."""
    ends = sorted({round((g + 1) * num_layers / groups) for g in range(groups)} - {0}) if groups > 0 else []
    return {end - 1: (start, end) for start, end in zip([0, *ends], ends)}


def done_notification(request_id: str) -> bytes:
    return WRITES_DONE_PREFIX + request_id.encode()


class PushWriter:
    def __init__(self, engine: LLMEngine, agent: NixlKVAgent, stats: NodeStats, layer_groups: int = 0):
        self.engine, self.agent, self.stats = engine, agent, stats
        self.targets: dict[str, Target] = {}
        self.connected: set[str] = set()
        self.writes = 0  # WRITEs posted and done (per layer group of a step, or per step and one at the end)
        self.failures = 0  # WRITEs that failed (a decode node gone): its requests' blocks are READ
        self.empty_targets = 0  # targets naming no blocks (no room there, or the router's word that it is lost)
        self.layer_writes = 0  # of the WRITEs, those posted mid-step: one group of layers of a step's blocks
        self.num_layers = int(engine.kv_cache.shape[1])
        self.groups = layer_group_spans(self.num_layers, layer_groups)
        if self.groups:
            engine.runner.layer_listener = self.stream_step

    def has(self, rid: str) -> bool:
        return rid in self.targets

    def take(self, msg: WriteTarget) -> None:
        """A decode node's blocks for a request this node computes (a target already taken, for a
        router that forwarded it twice, stays). One with no regions, or this node cannot use,
        is kept broken: the request's handover need not wait for it any more."""
        if msg.request_id in self.targets:
            return
        target = Target("", msg.first_block, list(msg.regions), time.monotonic() + msg.lease_s, msg.first_block)
        self.targets[msg.request_id] = target
        self.empty_targets += not msg.regions
        if not msg.regions or self.engine.kv.states is not None:
            target.broken = True  # (a hybrid model's state slot is READ with the blocks: not pushed)
        elif (why := peer_mismatch(msg.peer, self.engine.salt, self.agent.block_nbytes)) is not None:
            log.warning("[%s] not writing into %s: %s", msg.request_id, msg.peer.agent_name, why)
            target.broken = True
        if target.broken:
            return
        try:
            target.peer = self.agent.add_peer(msg.peer.metadata, msg.peer.agent_name)
            if target.peer not in self.connected:
                self.agent.make_connection(target.peer)
                self.connected.add(target.peer)
        except NixlTransferError as exc:
            log.warning("[%s] cannot reach %s to write: %s", msg.request_id, msg.peer.agent_name, exc)
            target.broken = True

    def peer_of(self, rid: str) -> str:
        """The loaded agent of the request's target's decode node; "" when it cannot be written to."""
        target = self.targets.get(rid)
        return target.peer if target is not None and not target.broken else ""

    def decline(self, msg: WriteTarget) -> None:
        """A target for a request this node no longer computes (it ended, or came late): tell
        the decode node no WRITE will come, so that an aborted request's blocks are freed now."""
        if not msg.regions:
            return  # (nothing was granted there)
        try:
            peer = self.agent.add_peer(msg.peer.metadata, msg.peer.agent_name)
            self.agent.send_notification(peer, done_notification(msg.request_id))
        except NixlTransferError as exc:
            log.debug("[%s] could not decline %s's target (its lease frees them): %s", msg.request_id,
                      msg.peer.agent_name, exc)

    def advance(self) -> None:
        """Write the whole blocks computed since the last call (between engine steps)."""
        bs = self.engine.config.block_size
        for rid, target in self.targets.items():
            req = self.engine.scheduler.requests.get(rid)
            if req is not None and not target.broken:
                self._write(rid, target, req.block_ids, req.num_slid_blocks, req.num_computed_tokens // bs)

    def finish(self, rid: str, handover: NixlHandover) -> NixlHandover:
        """The prompt is computed: write what is left, stop writing, and say in the handover what
        landed on the target."""
        target = self.targets.get(rid)
        if target is None:
            return handover
        held = self.engine.scheduler.held[rid]
        n_blocks = handover.first_block + len(handover.regions)
        if not target.broken:
            self._write(rid, target, held.block_ids, held.num_slid_blocks, n_blocks)
        self.forget(rid)
        if target.upto < n_blocks:
            return handover  # (not all of it: the decode node READs it all, as in pull mode)
        return msgspec.structs.replace(handover, written_to=target.peer, written_from=target.first_block,
                                       written=target.upto - target.first_block)

    def forget(self, rid: str) -> None:
        """No more writes for the request (handed over, aborted): the decode node may free its blocks."""
        target = self.targets.pop(rid, None)
        if target is None or not target.peer:
            return
        try:
            self.agent.send_notification(target.peer, done_notification(rid))
        except NixlTransferError as exc:
            log.debug("[%s] could not tell %s the writes ended (its lease frees them): %s", rid, target.peer, exc)

    def stream_step(self, items) -> Callable[[int], None] | None:
        """The runner's LayerListener: a step's blocks of requests with a live target, or None."""
        bs, plans = self.engine.config.block_size, []
        for req, n in items:
            target = self.targets.get(req.request_id)
            if target is None or target.broken:
                continue
            # The whole blocks the step completes, and the prompt's partial last block with its last
            # chunk: no block is written twice.
            done = req.num_computed_tokens + n
            first = max(target.first_block, target.upto)
            end = min(-(-done // bs) if done >= req.num_prompt_tokens else done // bs,
                      target.first_block + len(target.regions))
            if end <= first or not self._usable(target, first, req.num_slid_blocks):
                continue
            plans.append(StreamedBlocks(target, req.request_id, first, end, req.block_ids[first:end]))
        if not plans:
            return None
        expected = iter(range(self.num_layers))
        return lambda layer: self._layer_stored(plans, layer, next(expected, -1))

    def _layer_stored(self, plans: list[StreamedBlocks], layer: int, expected: int) -> None:
        if layer != expected:  # layers out of order: this step is written after it, as without streaming
            plans.clear()
        span = self.groups.get(layer)
        if span is None or not plans:
            return
        for plan in plans:
            if not plan.target.broken and self._post(plan.rid, plan.target, plan.block_ids, plan.first, plan.end,
                                                     (*span, self.num_layers)):
                self.layer_writes += 1
        if span[1] == self.num_layers:
            for plan in plans:  # every layer of the step's blocks is there
                if not plan.target.broken:
                    plan.target.upto = max(plan.target.upto, plan.end)

    def _usable(self, target: Target, first: int, slid: int) -> bool:
        """Whether blocks from `first` may still be written (marks the target broken if not)."""
        if first < slid or time.monotonic() > target.lease_end:
            target.broken = True  # blocks slid away here, or the decode node may have freed them
        return not target.broken

    def _post(self, rid: str, target: Target, block_ids: list[int], first: int, end: int,
              layers: tuple[int, int, int] | None = None) -> bool:
        """WRITE prompt blocks [first, end) (block_ids: this node's) into the target, all their
        layers or layers (start, end, of); False when it failed."""
        t0 = time.perf_counter()
        try:
            handle = self.agent.start_write(target.peer, block_ids,
                                            target.regions[first - target.first_block:end - target.first_block],
                                            timeout_s=WRITE_TIMEOUT_S, layers=layers)
            self.agent.wait(handle)
        except (NixlTransferError, ValueError, IndexError) as exc:
            self._failed(rid, target, exc)
            return False
        self.stats.transfer_bytes_nixl_written += handle.nbytes
        self.stats.transfer_us_nixl_written += int((time.perf_counter() - t0) * 1e6)
        self.writes += 1
        return True

    def _failed(self, rid: str, target: Target, exc: Exception) -> None:
        log.warning("[%s] WRITE into %s failed (the decode node will READ): %s", rid, target.peer, exc)
        self.failures += 1
        for other in self.targets.values():  # a peer gone fails them all: one timeout, not one each
            other.broken = other.broken or other.peer == target.peer
        target.broken = True

    def _write(self, rid: str, target: Target, block_ids: list[int], slid: int, upto: int) -> None:
        upto = min(upto, target.first_block + len(target.regions))
        if upto <= target.upto or not self._usable(target, target.upto, slid):
            return
        if self._post(rid, target, block_ids[target.upto:upto], target.upto, upto):
            target.upto = upto

    def close(self) -> None:
        for rid in list(self.targets):
            self.forget(rid)
