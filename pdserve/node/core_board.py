"""Cores lent between the nodes of one machine (`pdserve up --lend-idle-cores`).

`pdserve up` gives each node its share of the cores (two nodes on two cores: one thread each), so
that nodes busy at once do not oversubscribe the machine. But under disaggregation the roles are
seldom busy at once: at a low rate a prefill node computes a long prompt on its one core while
the decode node's core idles, and a monolithic node of two threads gets the same prompt out
1.6 times sooner (SmolLM2, 1,280 tokens: 2.69 s at one thread, 1.67 s at two).

So the nodes share a board: a small file every node maps, one slot per node holding its share
and whether it is computing. Before each step a node marks itself busy and runs that step with
its own share plus the shares of the nodes that are idle; after the step it marks itself idle
unless it has more to compute. Marking busy before reading the others means two nodes that start
at once each see the other busy (one thread each), never both a lent core. A node killed while
busy leaves its slot busy until its restart takes the slot over: lending stops, nothing
oversubscribes.

Thread counts change between steps only: torch's intra-op pool (process-wide) and numba's
(per calling thread, so on the compute thread that runs the steps; the compiled kernels take
numba's count per call).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TypeVar

import numpy as np

T = TypeVar("T")
SLOTS = 64  # nodes a board holds; a node past them runs on its own share
BOARD_ENV, SLOT_ENV = "PDSERVE_CORE_BOARD", "PDSERVE_CORE_SLOT"


def create_board(path: str) -> None:
    """The launcher's: an empty board (every slot: share 0, idle)."""
    np.zeros((SLOTS, 2), dtype=np.int64).tofile(path)


class CoreBoard:
    def __init__(self, path: str, slot: int, share: int, cores: int):
        self.table = np.memmap(path, dtype=np.int64, mode="r+", shape=(SLOTS, 2))
        self.slot, self.share, self.cores = slot, share, cores
        self.table[slot] = (share, 1)
        self.threads = 0  # what the pools are set to now (0: not set by the board yet)
        self.lent_steps = 0  # steps run on more than the node's share (in its stats)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> CoreBoard | None:
        """The board `pdserve up` named in this node's environment, the node's share its
        OMP_NUM_THREADS; None when it named none, or the slot or the share is not a count."""
        path, slot, share = env.get(BOARD_ENV), env.get(SLOT_ENV, ""), env.get("OMP_NUM_THREADS", "")
        if not path or not slot.isdigit() or int(slot) >= SLOTS or not share.isdigit() or int(share) < 1:
            return None
        return cls(path, int(slot), int(share), max(machine_cores(), int(share)))

    def step_threads(self) -> int:
        """Mark this node busy, then its share plus every idle node's, up to the machine's cores."""
        self.table[self.slot, 1] = 1
        others = np.delete(np.asarray(self.table), self.slot, axis=0)
        lent = int(others[others[:, 1] == 0, 0].sum())
        return min(self.share + lent, self.cores)

    def mark_idle(self) -> None:
        self.table[self.slot, 1] = 0

    def run(self, work: Callable[[], T]) -> T:
        """work() (a step, on the compute thread) with this step's threads."""
        threads = self.step_threads()
        if threads != self.threads:
            set_compute_threads(threads)
            self.threads = threads
        if threads > self.share:
            self.lent_steps += 1
        return work()

    def close(self) -> None:
        self.table[self.slot] = (0, 0)  # leaves: lends nothing, borrows nothing
        self.table.flush()


def machine_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_compute_threads(threads: int) -> None:
    """torch's pool and numba's (this thread's) at `threads`."""
    # deferred: loads torch; this module is imported by the launcher, which stays torch-free
    from pdserve.executor.group import set_rank_threads
    set_rank_threads(threads)
