"""Cores lent between the nodes of one machine (`pdserve up --lend-idle-cores`).

`pdserve up` gives each node its share of the cores (two nodes on two cores: one thread each), so
that nodes busy at once do not oversubscribe the machine. But under disaggregation the roles are
seldom busy at once: at a low rate a prefill node computes a long prompt on its one core while
the decode node's core idles, and a monolithic node of two threads gets the same prompt out
1.6 times sooner (SmolLM2, 1,280 tokens: 2.69 s at one thread, 1.67 s at two).

So the nodes share a board: a small file every node maps, one slot per node holding its share
and since when it has been idle (0: computing). Before each step a node marks itself busy and
runs that step with its own share plus the shares of the nodes idle for at least LEND_AFTER_S;
after the step it marks itself idle unless it has more to compute. Marking busy before reading
the others means two nodes that start at once each see the other busy (one thread each), never
both a lent core. A node killed while busy leaves its slot busy until its restart takes the slot
over: lending stops, nothing oversubscribes.

Only a node idle for a while lends: under load a decode node idles for moments between streams,
and a prefill step that borrowed its core then overlapped its next decode steps, three threads on
two cores, whose OpenMP barriers spin (measured: a 1,280-token prefill at two threads beside a
busy core took 5.8 s against 2.9 s at one thread; 64-256-token prompts at 4 req/s went from 81%
to 38% of requests within their targets with immediate lending).

And only a step with a long prompt to compute borrows (one request with LEND_MIN_PREFILL_TOKENS
of its prompt left, by default): a short prompt meets its TTFT on one core (a 256-token prefill
takes 0.6 s at one thread), so a second core saves it little, while a borrowed core that its
node wants back mid-step slows both nodes. A long prompt is where one core misses the target
(1,280 tokens: 2.69 s) and two meet it. A queue of short prompts does not borrow either: it
builds under load, when the node that lends is about to want its core back (measured: with the
rule counting queued tokens instead, 64-256-token prompts at 2 req/s and 128 out went from 100%
to 62% of requests within their targets).

Thread counts change between steps only: torch's intra-op pool (process-wide) and numba's
(per calling thread, so on the compute thread that runs the steps; the compiled kernels take
numba's count per call). numba caps its count at the pool it sizes at start (NUMBA_NUM_THREADS),
so the launcher sizes a lending node's pool to the machine and the board sets the count.

A step with nothing ready to compute (a push-mode decode node's, whose requests all wait for the
KV their prefill node computes) does not mark the node busy: marked busy while it ran, the node
lent nothing to the prefill step that began meanwhile, that very prompt's.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import numpy as np

T = TypeVar("T")
SLOTS = 64  # nodes a board holds; a node past them runs on its own share
LEND_AFTER_S = 0.25  # a node lends its cores once idle this long
LEND_MIN_PREFILL_TOKENS = 512  # a step borrows only for a prompt with this many tokens left to compute
BOARD_ENV, SLOT_ENV, MIN_TOKENS_ENV = "PDSERVE_CORE_BOARD", "PDSERVE_CORE_SLOT", "PDSERVE_CORE_BORROW_MIN_TOKENS"


def create_board(path: str) -> None:
    """The launcher's: an empty board (every slot: share 0, idle)."""
    np.zeros((SLOTS, 2), dtype=np.int64).tofile(path)


class CoreBoard:
    def __init__(self, path: str, slot: int, share: int, cores: int,
                 min_prefill_tokens: int = LEND_MIN_PREFILL_TOKENS):
        self.table = np.memmap(path, dtype=np.int64, mode="r+", shape=(SLOTS, 2))
        self.slot, self.share, self.cores = slot, share, cores
        self.min_prefill_tokens = min_prefill_tokens
        self.table[slot] = (share, 0)
        self.threads = 0  # what the pools are set to now (0: not set by the board yet)
        self.lent_steps = 0  # steps run on more than the node's share (in its stats)
        self.kernel_threads = 0  # the compiled kernels' threads now (numba's count; at most its pool's)
        self.widest_lent_threads = 0  # the most of them a lent step ran (in its stats)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> CoreBoard | None:
        """The board `pdserve up` named in this node's environment, the node's share its
        OMP_NUM_THREADS; None when it named none, or the slot or the share is not a count."""
        path, slot, share = env.get(BOARD_ENV), env.get(SLOT_ENV, ""), env.get("OMP_NUM_THREADS", "")
        if not path or not slot.isdigit() or int(slot) >= SLOTS or not share.isdigit() or int(share) < 1:
            return None
        min_tokens = env.get(MIN_TOKENS_ENV, "")
        return cls(path, int(slot), int(share), max(machine_cores(), int(share)),
                   int(min_tokens) if min_tokens.isdigit() else LEND_MIN_PREFILL_TOKENS)

    def step_threads(self, now_ns: int | None = None, prefill_tokens: int | None = None) -> int:
        """Mark this node busy, then its share plus the shares of the nodes idle for
        LEND_AFTER_S, up to the machine's cores; only its share when no prompt it has to compute
        has min_prefill_tokens left (prefill_tokens: the longest's; None: not known, borrow).
        (CLOCK_MONOTONIC is the machine's: every node's clock.)"""
        self.table[self.slot, 1] = 0
        if prefill_tokens is not None and prefill_tokens < self.min_prefill_tokens:
            return self.share
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        others = np.delete(np.asarray(self.table), self.slot, axis=0)
        idle = (others[:, 1] > 0) & (others[:, 1] <= now_ns - int(LEND_AFTER_S * 1e9))
        return min(self.share + int(others[idle, 0].sum()), self.cores)

    def mark_idle(self, now_ns: int | None = None) -> None:
        """Idle from now on, unless already idle (the time it went idle stays)."""
        if self.table[self.slot, 1] == 0:
            self.table[self.slot, 1] = time.monotonic_ns() if now_ns is None else now_ns

    def run(self, work: Callable[[], T], prefill_tokens: int | None = None,
            computed: Callable[[], bool] | None = None, ready: bool = True) -> T:
        """work() (a step, on the compute thread) with this step's threads; prefill_tokens: the
        longest prompt it has to compute, in tokens (None: borrow whatever is idle). ready:
        whether the step has anything to compute; one that has not (a decode node whose requests
        all wait for their KV, as a push-mode one does while its prompt computes elsewhere) runs
        on the node's share without marking it busy: marked busy, however briefly, the node
        lent nothing to the prefill step that began meanwhile, and in push mode that is the
        step of the very prompt its request waits for. computed: whether the step computed
        anything; one that did not leaves the node idle since when it was, so its cores stay lent."""
        if not ready:
            self._set_threads(self.share)
            return work()
        idle_since = int(self.table[self.slot, 1])
        threads = self.step_threads(prefill_tokens=prefill_tokens)
        self._set_threads(threads)
        if threads > self.share:
            self.lent_steps += 1
            self.widest_lent_threads = max(self.widest_lent_threads, self.kernel_threads)
        result = work()
        if idle_since and computed is not None and not computed():
            self.table[self.slot, 1] = idle_since
        return result

    def _set_threads(self, threads: int) -> None:
        if threads != self.threads:
            self.kernel_threads = set_compute_threads(threads)
            self.threads = threads

    def close(self) -> None:
        self.table[self.slot] = (0, 0)  # leaves: lends nothing, borrows nothing
        self.table.flush()


def machine_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_compute_threads(threads: int) -> int:
    """torch's pool and numba's (this thread's) at `threads`; the compiled kernels' count now."""
    # deferred: loads torch; this module is imported by the launcher, which stays torch-free
    from pdserve.executor.group import set_rank_threads
    return set_rank_threads(threads)
