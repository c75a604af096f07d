"""A decode node that computes a prompt itself writes the prompt's full blocks the store lacks to
the shared store, as a prefill node's handover does, so the next turn of the conversation finds
its history there wherever the router places it (and after this node's LRU has let it go).

The put runs on a thread of its own, off the decode steps: the running streams do not wait for
it. The blocks it reads hold a reference of their own until it ends, so a request that finishes
or is aborted meanwhile cannot hand them to another request while they are read.

A hybrid model's prompt is of use to other nodes only with its recurrent state: the snapshots
this node took at the prompt's block boundaries (copied on the node's loop, as a snapshot may be
evicted) go to the store too, under their blocks' state keys."""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pdserve.kvstore.base import KVStore
from pdserve.kvstore.errors import KVStoreError
from pdserve.protocol.block_keys import state_key

log = logging.getLogger(__name__)


@dataclass
class Owed:
    """A prompt computed here: its block keys, and the first block the store lacks."""
    keys: list[bytes]
    first_block: int


@dataclass
class Write:
    future: Future
    block_ids: list[int]  # pinned until the put ends


class StoreWriteBack:
    def __init__(self, engine, store: KVStore, stats):
        self.engine, self.store, self.stats = engine, store, stats
        self.owed: dict[str, Owed] = {}  # request id -> what to write once its prompt is computed
        self.writes: dict[str, Write] = {}
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="kv-writeback")

    def owe(self, rid: str, keys: list[bytes], prompt_len: int, stored_tokens: int) -> None:
        """The request computes its prompt here: write its full blocks past the stored prefix."""
        bs = self.engine.config.block_size
        if prompt_len // bs > stored_tokens // bs:
            self.owed[rid] = Owed(keys[:prompt_len // bs], stored_tokens // bs)

    def prompt_done(self, rid: str) -> None:
        """The request's prompt is computed (its first token is out): start the put."""
        owed = self.owed.pop(rid, None)
        req = self.engine.scheduler.requests.get(rid)
        if owed is None or req is None:
            return
        first = max(owed.first_block, req.num_slid_blocks)  # blocks out of the window are not held
        ids = req.block_ids[first:len(owed.keys)]
        if not ids:
            return
        self.engine.pool.touch(ids)
        bs = self.engine.config.block_size
        keys = owed.keys[first:first + len(ids)]
        future = self.writer.submit(self._put, keys, ids, [bs] * len(ids), first, self._states(keys))
        self.writes[rid] = Write(future, ids)

    def answer_done(self, rid: str, keys: list[bytes], first: int) -> None:
        """A stream that ended here: the full blocks of what it generated (keys[first:], still in
        this node's prefix cache) go to the store too, so the conversation's next turn is
        prefilled from its whole history there, not by recomputing the answer."""
        rid = f"{rid}/answer"  # beside its prompt's write, which may still run
        if rid in self.writes or self.engine.kv.states is not None:  # (a hybrid's state is not kept per block here)
            return
        ids = []
        for key in keys[first:]:
            if (block_id := self.engine.pool.lookup(key)) is None:
                break
            ids.append(block_id)
        if not ids:
            return
        self.engine.pool.touch(ids)  # a reference of its own until the put ends
        bs = self.engine.config.block_size
        future = self.writer.submit(self._put, keys[first:first + len(ids)], ids, [bs] * len(ids), first)
        self.writes[rid] = Write(future, ids)

    def _states(self, keys: list[bytes]) -> list[tuple[bytes, torch.Tensor]]:
        """A hybrid model's snapshots after these blocks, copied, under their state keys."""
        snaps, states = self.engine.kv.snapshots, self.engine.kv.states
        if snaps is None:
            return []
        return [(state_key(k, states.layout), snaps.get(k)) for k in keys if k in snaps]

    def _put(self, keys: list[bytes], block_ids: list[int], counts: list[int], first: int,
             states: list[tuple[bytes, torch.Tensor]] = ()) -> bool:
        try:
            self.store.put(keys, self.engine.kv_cache, block_ids, counts, first_block=first)
            for key, row in states:
                self.store.put_state(key, row.view(1, -1), 0)
            return True
        except KVStoreError as exc:  # the store is a cache: the next turn computes instead
            log.warning("store write-back failed: %s", exc)
            return False

    def poll(self) -> None:
        """Unpin the blocks of the puts that ended, and count what they wrote."""
        for rid in [r for r, w in self.writes.items() if w.future.done()]:
            write = self.writes.pop(rid)
            self.engine.pool.free(write.block_ids[::-1])  # tail-first, as requests free
            if write.future.result():
                # counted apart from transfer_bytes_store, which stays the handover's bytes (what
                # the decode node loaded): tests and benchmarks read it as such
                self.stats.writeback_blocks += len(write.block_ids)

    def forget(self, rid: str) -> None:
        """Aborted before its prompt was computed: nothing to write (a put in flight ends as it is)."""
        self.owed.pop(rid, None)

    def idle(self) -> bool:
        return not self.writes

    def close(self) -> None:
        self.writer.shutdown(wait=True, cancel_futures=True)
        self.poll()
