"""Block-level KV transfer between processes over NIXL (UCX backend; CPU DRAM or CUDA VRAM).

The paged cache is one block-major tensor kv_cache[num_blocks, ...], so block b is the single
byte range [base + b * block_nbytes, +block_nbytes). The prefill side pins blocks and sends
their regions (plain ints, see pdserve.wire.handover); the decode side READs them into its own blocks
with a notification, and the prefill side frees the blocks when that notification arrives.

An agent is not thread-safe in NIXL's default sync mode, so every agent call here holds a lock.

Defaults chosen for CPU peers on one host (measured on a 2-core box, see benchmarks/kv_transfer/bench_nixl.py):
- error_handling="none": NIXL's UCX default ("peer") needs a peer-failure handler, which UCX's
  shared-memory transports lack, so UCX's control lane falls back to TCP loopback. The bytes
  still move by cma (process_vm_readv), but a READ only completes once the target has
  progressed the TCP lane, so the target must poll or run a progress thread. With "none" the
  control lane is shared memory and READs complete without the target: one-sided, one copy.
  A dead peer still surfaces as a disconnect error (tested).
- progress_thread=False: NIXL's progress thread busy-polls (zero delay, not configurable from
  Python), burning a whole core per agent. Without it, progress happens inside our calls:
  the reader's poll/wait and the target's get_notifications (which is also how notifications
  arrive). With error_handling="peer", or across hosts over TCP, the target must call
  get_notifications often, or use progress_thread=True.
- UCX's adaptive progress off (ENGINE_CONFIG): with it (UCX's default) a worker stops polling its
  shared-memory FIFOs at creation and waits for a peer's wake-up signal, sent over a Unix socket
  in the abstract namespace, which does not cross network namespaces. Two nodes in two network
  namespaces of one kernel (a Ray lab, containers with their own network) are intra-node peers
  to UCX (same boot id, same IPC namespace), so the reader's wireup request sat in the target's
  FIFO unread and the READ waited for its deadline (docs/testing.md). Polling always costs the
  target a check of an empty FIFO per progress call.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from pdserve.kvstore.descriptor_regions import Region, coalesce_pairs, layer_slices

logger = logging.getLogger(__name__)

XferState = Literal["DONE", "PROC", "ERR"]
# UCX settings for every agent's worker (its UCX_* environment variables still take precedence)
ENGINE_CONFIG = "ADAPTIVE_PROGRESS=n"

# Quiet UCX's and NIXL's own logging unless the user asked for something else.
_QUIET_ENV = {"UCX_LOG_LEVEL": "error", "NIXL_LOG_LEVEL": "WARN"}


class NixlTransferError(RuntimeError):
    """A NIXL operation failed: bad peer, bad descriptors, remote gone, or transfer ERR."""


class NixlTimeoutError(NixlTransferError):
    """A transfer stayed in progress past its deadline (e.g. a hung peer)."""


def _import_nixl() -> tuple[Any, Any]:
    """Import nixl lazily: it is an optional extra and costs ~2 s to import."""
    for key, value in _QUIET_ENV.items():
        os.environ.setdefault(key, value)
    raise_exc = logging.raiseExceptions
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # optional dependency: nixl (the pdserve[nixl] extra)
    except ImportError as exc:
        raise ImportError(f"NIXL is not available: {exc}") from exc
    finally:
        # nixl's logging setup flips this process-wide flag; keep the host's choice.
        logging.raiseExceptions = raise_exc
    return nixl_agent, nixl_agent_config


def nixl_import_error() -> str | None:
    """None if NIXL imports here, else why not (for skips and startup checks)."""
    try:
        _import_nixl()
    except ImportError as exc:
        return str(exc)
    return None


def _create_agent(name: str, error_handling: str, progress_thread: bool,
                  num_threads: int) -> Any:
    nixl_agent, nixl_agent_config = _import_nixl()
    # Backend created by hand: nixl_agent_config cannot pass UCX's error-handling mode.
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=[]))
    params = {"ucx_error_handling_mode": error_handling, "engine_config": ENGINE_CONFIG}
    if num_threads > 0:
        params["num_threads"] = str(num_threads)
    try:
        agent.create_backend("UCX", params)
    except Exception as exc:
        raise NixlTransferError(f"UCX backend failed to start: {exc!r}") from exc
    return agent


@dataclass
class NixlReadHandle:
    """An in-flight READ. state is sticky once DONE or ERR."""

    xfer: Any
    peer: str
    nbytes: int
    num_descs: int
    started_at: float
    deadline: float
    state: XferState = "PROC"
    error: str = ""
    released: bool = field(default=False, repr=False)


class NixlKVAgent:
    """A NIXL agent over one kv_cache tensor: CPU memory registers as DRAM, CUDA memory as VRAM.

    Both sides of a READ must use the same memory kind (regions carry the device id only).
    A hybrid model's state arena (pdserve.engine.state_pool: one contiguous slot per request)
    registers with it: a request's slot is READ with its blocks, in the same transfer.
    """

    def __init__(self, name: str, kv_cache: torch.Tensor, *,
                 error_handling: Literal["none", "peer"] = "none",
                 progress_thread: bool = False, num_threads: int = 0,
                 state_arena: torch.Tensor | None = None) -> None:
        if kv_cache.device.type not in ("cpu", "cuda") or not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be a contiguous CPU or CUDA tensor")
        self.mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.dev_id = (kv_cache.device.index or 0) if kv_cache.is_cuda else 0
        self.name = name
        self.kv_cache = kv_cache
        self.num_blocks = int(kv_cache.shape[0])
        self.block_nbytes = kv_cache[0].numel() * kv_cache.element_size()
        self._base = kv_cache.data_ptr()
        self._lock = threading.RLock()
        self._peers: dict[bytes, str] = {}  # metadata -> agent name, makes add_peer idempotent
        self._unreleased: list[NixlReadHandle] = []  # handles whose abort failed; retried later
        t0 = time.perf_counter()
        self._agent: Any = _create_agent(name, error_handling, progress_thread, num_threads)
        self.state_arena = state_arena
        self.slot_nbytes = 0 if state_arena is None else int(state_arena.shape[1])
        self._reg = self._agent.register_memory(kv_cache if state_arena is None else [kv_cache, state_arena],
                                                self.mem_type)
        logger.info("NIXL agent %s up in %.2fs: %d blocks of %d bytes", name,
                    time.perf_counter() - t0, self.num_blocks, self.block_nbytes)


    def metadata(self) -> bytes:
        """This agent's metadata; send it to each peer once (in a wire.handover.NixlMetadata)."""
        with self._lock:
            return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes, name_hint: str = "") -> str:
        """Load a peer's metadata; returns its agent name. Same metadata twice is a no-op.

        A restarted peer keeps its name and sends new metadata, which NIXL refuses while it
        holds the old (NIXL_ERR_NOT_ALLOWED): `name_hint` names the peer, whose stale entry is
        then dropped and the load retried once.
        """
        with self._lock:
            if metadata in self._peers:
                return self._peers[metadata]
            try:
                raw = self._agent.add_remote_agent(metadata)
            except Exception as exc:
                if name_hint not in self._peers.values():
                    raise NixlTransferError(f"add_remote_agent failed: {exc!r}") from exc
                logger.info("NIXL peer %s came back with new metadata: reloading it", name_hint)
                self._agent.remove_remote_agent(name_hint)
                self._peers = {m: n for m, n in self._peers.items() if n != name_hint}
                try:
                    raw = self._agent.add_remote_agent(metadata)
                except Exception as exc2:
                    raise NixlTransferError(f"add_remote_agent failed: {exc2!r}") from exc2
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            # A restarted peer keeps its name but sends new metadata: forget the old entry.
            self._peers = {m: n for m, n in self._peers.items() if n != name}
            self._peers[metadata] = name
            return name

    def make_connection(self, peer: str) -> None:
        """Warm up the UCX endpoint so the first READ does not pay connection setup."""
        with self._lock:
            try:
                self._agent.make_connection(peer)
            except Exception as exc:
                raise NixlTransferError(f"make_connection({peer}) failed: {exc!r}") from exc

    def remove_peer(self, peer: str) -> None:
        """Forget a peer (disconnects); later READs from it fail fast."""
        with self._lock:
            self._peers = {m: n for m, n in self._peers.items() if n != peer}
            try:
                self._agent.remove_remote_agent(peer)
            except Exception as exc:  # already gone is fine: we only want it unusable
                logger.debug("remove_remote_agent(%s): %r", peer, exc)


    def block_regions(self, block_ids: Iterable[int]) -> list[Region]:
        """(addr, nbytes, dev_id) of each block, as plain ints for a side-channel message."""
        out: list[Region] = []
        for b in block_ids:
            b = int(b)
            if not 0 <= b < self.num_blocks:
                raise IndexError(f"block id {b} outside [0, {self.num_blocks})")
            out.append((self._base + b * self.block_nbytes, self.block_nbytes, self.dev_id))
        return out

    def slot_region(self, slot: int) -> Region:
        """(addr, nbytes, dev_id) of one state slot of the registered arena."""
        if self.state_arena is None or not 0 <= slot < self.state_arena.shape[0]:
            raise IndexError(f"no state slot {slot} registered")
        return (self.state_arena.data_ptr() + slot * self.slot_nbytes, self.slot_nbytes, self.dev_id)


    def start_read(self, peer: str, remote_regions: Sequence[Region],
                   local_block_ids: Sequence[int], notif: bytes = b"",
                   timeout_s: float = 30.0, state: tuple[Region, int] | None = None) -> NixlReadHandle:
        """READ remote_regions[i] into local block local_block_ids[i]; one batched xfer.
        state: (remote slot region, local slot), READ in the same xfer (blocks may then be none).

        The peer gets `notif` once the whole READ has completed. Raises NixlTransferError if it
        cannot be posted (unknown or dead peer, unregistered addresses). Over cma the copy runs
        inside this call (~13 ms per 64 MiB here) with the GIL released.
        """
        local = self._check_pairs(remote_regions, local_block_ids, state is not None)
        remote = [tuple(map(int, r)) for r in remote_regions]
        if state is not None:
            if int(state[0][1]) != self.slot_nbytes:  # another state layout would scramble the slot
                raise ValueError(f"remote state slot of {state[0][1]} bytes, local slots are {self.slot_nbytes}")
            local, remote = [*local, self.slot_region(state[1])], [*remote, tuple(map(int, state[0]))]
        return self._post("READ", peer, local, remote, notif, timeout_s)

    def start_write(self, peer: str, local_block_ids: Sequence[int], remote_regions: Sequence[Region],
                    notif: bytes = b"", timeout_s: float = 30.0,
                    layers: tuple[int, int, int] | None = None) -> NixlReadHandle:
        """WRITE local block local_block_ids[i] into the peer's remote_regions[i] (push mode: the
        decode node's blocks waiting for this prompt); polled and waited on as a READ is.
        layers (start, end, of): only layers [start, end) of each block's `of`, which lie one
        after another in a block-major cache."""
        local = self._check_pairs(remote_regions, local_block_ids)
        remote = [tuple(map(int, r)) for r in remote_regions]
        if layers is not None:
            start, end, of = layers
            local, remote = (layer_slices(regions, start, end, of) for regions in (local, remote))
        return self._post("WRITE", peer, local, remote, notif, timeout_s)

    def _post(self, op: str, peer: str, local: list[Region], remote: list[Region], notif: bytes,
              timeout_s: float) -> NixlReadHandle:
        loc, rem = coalesce_pairs(local, remote)
        now = time.monotonic()
        with self._lock:
            xfer = None
            try:
                loc_d = self._agent.get_xfer_descs(loc, self.mem_type)
                rem_d = self._agent.get_xfer_descs(rem, self.mem_type)
                xfer = self._agent.initialize_xfer(op, loc_d, rem_d, peer, notif)
                state = self._agent.transfer(xfer)
            except Exception as exc:
                if xfer is not None:
                    self._release(NixlReadHandle(xfer, peer, 0, 0, now, now))
                raise NixlTransferError(f"{op} with {peer} failed to post: {exc!r}") from exc
        handle = NixlReadHandle(xfer, peer, sum(n for _, n, _ in local), len(loc), now, now + timeout_s)
        if state == "ERR":
            self._finish(handle, "ERR", "transfer() returned ERR")
            raise NixlTransferError(f"{op} with {peer} failed to post: ERR")
        if state == "DONE":
            self._finish(handle, "DONE")
        return handle

    def _check_pairs(self, remote_regions: Sequence[Region],
                     local_block_ids: Sequence[int], with_state: bool = False) -> list[Region]:
        if len(remote_regions) != len(local_block_ids):
            raise ValueError(f"{len(remote_regions)} remote regions for "
                             f"{len(local_block_ids)} local blocks")
        if not remote_regions and not with_state:
            raise ValueError("empty READ")
        if len(set(local_block_ids)) != len(local_block_ids):
            raise ValueError("duplicate local block ids")
        for addr, nbytes, _dev in remote_regions:
            # Different block layouts on the two sides would silently scramble the cache.
            if nbytes != self.block_nbytes:
                raise ValueError(f"remote block of {nbytes} bytes at {addr:#x}, "
                                 f"local blocks are {self.block_nbytes}")
        return self.block_regions(local_block_ids)

    def poll(self, handle: NixlReadHandle) -> XferState:
        """DONE / PROC / ERR; releases the NIXL handle on DONE/ERR and after the deadline."""
        if handle.state != "PROC":
            return handle.state
        with self._lock:
            try:
                state = self._agent.check_xfer_state(handle.xfer)
            except Exception as exc:
                self._finish(handle, "ERR", f"check_xfer_state: {exc!r}")
                return "ERR"
        if state == "PROC" and time.monotonic() > handle.deadline:
            self._finish(handle, "ERR", "deadline passed")
            return "ERR"
        if state != "PROC":
            self._finish(handle, state, "" if state == "DONE" else "transfer ERR")
        return handle.state

    def wait(self, handle: NixlReadHandle, poll_interval_s: float = 0.0005) -> float:
        """Block until the READ ends; returns seconds taken, raises on ERR or deadline."""
        while self.poll(handle) == "PROC":
            time.sleep(poll_interval_s)
        if handle.state == "ERR":
            kind = NixlTimeoutError if handle.error == "deadline passed" else NixlTransferError
            raise kind(f"transfer with {handle.peer}: {handle.error}")
        return time.monotonic() - handle.started_at

    def _finish(self, handle: NixlReadHandle, state: XferState, error: str = "") -> None:
        handle.state = state
        handle.error = error
        if state == "ERR":
            logger.warning("NIXL transfer with %s (%d bytes) failed: %s",
                           handle.peer, handle.nbytes, error)
        self._release(handle)

    def _release(self, handle: NixlReadHandle) -> None:
        # Releasing an active xfer asks NIXL to cancel it; if that fails the local blocks
        # may still be written, so keep the handle and retry instead of dropping it.
        with self._lock:
            try:
                self._agent.release_xfer_handle(handle.xfer)
                handle.released = True
            except Exception as exc:
                logger.error("could not release READ from %s: %r", handle.peer, exc)
                if handle not in self._unreleased:
                    self._unreleased.append(handle)

    def release_pending(self) -> int:
        """Retry releasing handles whose cancel failed; returns how many remain."""
        for handle in list(self._unreleased):
            self._unreleased.remove(handle)
            self._release(handle)
        return len(self._unreleased)


    def get_notifications(self) -> list[tuple[str, bytes]]:
        """New notifications as (sender agent name, message), in arrival order per sender."""
        with self._lock:
            notifs = self._agent.get_new_notifs()
        return [(str(peer), bytes(msg)) for peer, msgs in notifs.items() for msg in msgs]

    def send_notification(self, peer: str, msg: bytes) -> None:
        """A notification not tied to a transfer (e.g. 'rejected, free these blocks')."""
        with self._lock:
            try:
                self._agent.send_notif(peer, msg)
            except Exception as exc:
                raise NixlTransferError(f"send_notif to {peer} failed: {exc!r}") from exc


    def close(self) -> None:
        """Release handles, forget peers, deregister memory and drop the agent. Idempotent."""
        with self._lock:
            if self._agent is None:
                return
            if self.release_pending():
                logger.error("%d NIXL READs could not be cancelled", len(self._unreleased))
            for peer in set(self._peers.values()):
                self.remove_peer(peer)
            try:
                self._agent.deregister_memory(self._reg)
            except Exception as exc:
                logger.warning("deregister_memory failed: %r", exc)
            self._agent = None
            self._reg = None

    def __enter__(self) -> NixlKVAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
