"""The TP group's rendezvous: a TCPStore on loopback that the driver opens (port 0: the kernel
picks a free one, no race) and the workers join, and a process group over it: gloo on CPU,
NCCL on CUDA, one code path. The group is a standalone ProcessGroup, not torch.distributed's
default group, so one process can build (and drop) several engines."""
from __future__ import annotations

import dataclasses
import datetime
import os
import time

import torch
import torch.distributed as dist

from pdserve.executor.shm_collectives import ShmCollectives
from pdserve.layers.parallel import TPGroup

# A collective waits at most this long for a peer. Workers wait for steps on their pipe, never
# in a collective, so an idle node does not trip it; a lost peer usually fails a collective at
# once (its socket closes) and the driver's watcher notices a dead worker within a second.
DEFAULT_TIMEOUT_S = 120.0


def open_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def join_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def make_group(store: dist.TCPStore, rank: int, world_size: int, device: torch.device,
               timeout_s: float, shm: ShmCollectives | None = None) -> TPGroup:
    """shm: the node's shared-memory collectives (CPU), used for every tensor that fits them."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        pg = dist.ProcessGroupNCCL(store, rank, world_size, dist.ProcessGroupNCCL.Options())
    else:
        pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    return NodeTPGroup(rank=rank, size=world_size, group=pg, shm=shm if use_shm_collectives() else None)


@dataclasses.dataclass(frozen=True)
class RankGroups:
    """A rank's groups: its stage's TP group (the layers' collectives; size 1 without TP), and
    the group of every rank of the node (the step-input broadcast, the links between stages).
    Without pipeline stages they are one group."""
    tp: TPGroup
    world: TPGroup


def make_rank_groups(store: dist.TCPStore, rank: int, tp_size: int, pp_size: int, device: torch.device,
                     timeout_s: float, shm: ShmCollectives | None = None) -> RankGroups:
    """Every rank builds the same groups in the same order (each build is a rendezvous): the
    node's, then its stage's, each under a store prefix of its own."""
    if pp_size == 1:
        group = make_group(store, rank, tp_size, device, timeout_s, shm)
        return RankGroups(group, group)
    # gloo for the stage links: hidden states cross between processes on the host (CPU for now).
    world = make_group(dist.PrefixStore("node", store), rank, tp_size * pp_size, torch.device("cpu"), timeout_s)
    if tp_size == 1:
        return RankGroups(TPGroup(), world)
    stage_store = dist.PrefixStore(f"stage{rank // tp_size}", store)
    return RankGroups(make_group(stage_store, rank % tp_size, tp_size, device, timeout_s, shm), world)


def use_shm_collectives() -> bool:
    return os.environ.get("PDSERVE_TP_COLLECTIVES", "shm") != "gloo"


@dataclasses.dataclass(frozen=True)
class NodeTPGroup(TPGroup):
    """The executor's TPGroup: shared-memory collectives where they fit (else torch.distributed),
    and the seconds spent in collectives, waiting for the slowest rank included, as a step pays
    it (the benchmark reads them)."""
    shm: ShmCollectives | None = None
    seconds: list = dataclasses.field(default_factory=lambda: [0.0])

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        try:
            if self.shm is not None and self.shm.fits(x):
                return self.shm.all_reduce(x)
            return super().all_reduce(x)
        finally:
            self.seconds[0] += time.perf_counter() - start

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        try:
            if self.shm is not None and self.shm.fits(x):
                return self.shm.all_gather_last(x)
            return super().all_gather_last(x)
        finally:
            self.seconds[0] += time.perf_counter() - start


def set_rank_threads(threads: int) -> int:
    """Compute threads of this rank's torch and numba pools (one per rank on a 2-core machine);
    the count numba took (the compiled kernels run at it), at most its pool's NUMBA_NUM_THREADS.

    numba first: its first set_num_threads starts its OpenMP pool, which sets the process's
    OpenMP thread count (torch's too, the same libgomp) to NUMBA_NUM_THREADS. Set the other way
    round, a TP driver kept torch at every core, and its idle OpenMP thread spun on the core
    its worker rank computes on."""
    taken = threads
    try:
        import numba  # optional here: a rank runs the torch kernels without it
        taken = min(threads, numba.config.NUMBA_NUM_THREADS)
        numba.set_num_threads(taken)
    except ImportError:
        pass
    torch.set_num_threads(threads)
    return taken
