"""The driver's side: start the workers, hold the TP group, send each step, watch the workers.

The driver is rank 0 and holds a shard itself: on a 2-core machine a driver that only sent
inputs and sampled would idle through every step on a core of its own, while as rank 0 it
computes its share between sending the inputs and sampling. Its logits arrive by the LM head's
gather, and it samples as at TP 1.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

import msgspec
import torch

from pdserve.executor.group import DEFAULT_TIMEOUT_S, make_rank_groups, open_store, set_rank_threads
from pdserve.executor.kv_shared import allocate_shared_file, create_shared_file, fd_path, map_shared
from pdserve.executor.messages import (
    LoadLoRA,
    MapStates,
    ReportWaits,
    Shutdown,
    StateLayer,
    StepPlan,
    WorkerSpec,
    write_message,
)
from pdserve.executor.shm_collectives import ShmCollectives, buffer_bytes
from pdserve.executor.stage_link import recv_waits
from pdserve.executor.step_channel import DEFAULT_CAPACITY, StepChannel
from pdserve.layers.parallel import TPGroup

log = logging.getLogger(__name__)
# Nodes set this (node_main): a worker that dies takes the node down, and its owner restarts
# it. Offline, the engine's next step raises instead.
EXIT_ON_WORKER_DEATH = False
WORKER_DEATH_EXIT_CODE = 3
STARTUP_TIMEOUT_S = 600.0


class WorkerLost(RuntimeError):
    pass


class TPExecutor:
    """Ranks 1..size-1 as child processes, the groups, the shared KV cache and step buffer.

    size = tp_size * pp_size ranks: rank r is TP rank r % tp_size of pipeline stage
    r // tp_size (pdserve.executor.stage_link); this process is rank 0, on the first stage."""

    def __init__(self, tp_size: int, model_path: str, dtype: torch.dtype, device: torch.device,
                 kernel_backend: str, kv_shape: tuple[int, ...], threads: int,
                 timeout_s: float = DEFAULT_TIMEOUT_S, expert_parallel: bool = False, pp_size: int = 1,
                 lora_slots: tuple[int, int] = (0, 0), kv_dtype: torch.dtype | None = None,
                 gemm_dtype: str = "float32", kv_prefault: bool = False, states: bool = False):
        """states: a hybrid model's, whose recurrent-state arena is shared too (map_states)."""
        if device.type != "cpu":
            raise ValueError("tensor_parallel_size > 1 and pipeline_parallel_size > 1 run on CPU for now (the "
                             "shared KV cache is host memory); see docs/tensor-parallelism.md")
        self.tp_size, self.pp_size, self.size = tp_size, pp_size, tp_size * pp_size
        self.kind = "tensor-parallel" if pp_size == 1 else "pipeline-parallel"  # (for messages)
        self.threads, self.lost = threads, None
        self.closing = threading.Event()  # set before the workers are told to stop: their exit is no loss
        self.expert_parallel = expert_parallel
        kv_dtype = kv_dtype or dtype  # an FP8 cache: float8_e4m3fn (pdserve.kernels.fp8_kv)
        nbytes = int(torch.tensor([], dtype=kv_dtype).element_size())
        for d in kv_shape:
            nbytes *= d
        self._kv_fd = create_shared_file(nbytes, "kv")
        if kv_prefault:
            allocate_shared_file(self._kv_fd, nbytes)
        self._payload_fd = create_shared_file(DEFAULT_CAPACITY * 8, "steps")
        # One shared-memory collectives buffer per stage, for its TP ranks (none without TP).
        self._coll_fds = [create_shared_file(buffer_bytes(tp_size), "collectives") for _ in range(pp_size)
                          ] if tp_size > 1 else []
        self.kv_cache = map_shared(fd_path(self._kv_fd), kv_shape, kv_dtype)
        # Sized once the driver's model says what a slot holds (map_states); inherited now.
        self._state_fd = create_shared_file(0, "states") if states else -1
        store = open_store(self.size, timeout_s)
        spec = dict(world_size=self.size, store_host="127.0.0.1", store_port=store.port, model_path=str(model_path),
                    dtype=str(dtype).removeprefix("torch."), device=str(device), kernel_backend=kernel_backend,
                    threads=threads, kv_fd=self._kv_fd, kv_shape=list(kv_shape), payload_fd=self._payload_fd,
                    payload_capacity=DEFAULT_CAPACITY, timeout_s=timeout_s, expert_parallel=expert_parallel,
                    pp_size=pp_size, max_loras=lora_slots[0], max_lora_rank=lora_slots[1],
                    kv_dtype=str(kv_dtype).removeprefix("torch."), gemm_dtype=gemm_dtype, state_fd=self._state_fd)
        self.workers = [self._start_watched(WorkerSpec(rank=r, collectives_fd=self._stage_coll_fd(r), **spec))
                        for r in range(1, self.size)]
        self._finalizer = weakref.finalize(self, _close_workers, list(self.workers), self.closing)
        atexit.register(self._finalizer)
        set_rank_threads(threads)
        self._store = store
        self._wait_for("joined")  # a worker that dies on start fails us now, not at the group's timeout
        shm = (ShmCollectives(self._coll_fds[0], 0, tp_size, self.raise_if_lost, timeout_s)
               if self._coll_fds else None)
        groups = make_rank_groups(store, 0, tp_size, pp_size, device, timeout_s, shm)
        self.group: TPGroup = groups.tp
        self.node_group: TPGroup = groups.world  # every rank: the step broadcast, the stage links
        self.channel = StepChannel(fd_path(self._payload_fd), DEFAULT_CAPACITY, self.node_group)

    def _stage_coll_fd(self, rank: int) -> int:
        return self._coll_fds[rank // self.tp_size] if self._coll_fds else -1

    def _start_watched(self, spec: WorkerSpec) -> subprocess.Popen:
        """Start a worker from a thread that then waits on it: PR_SET_PDEATHSIG fires when the
        thread that forked the child exits, so that thread must live exactly as long as the
        child (an engine built on a short-lived thread would otherwise lose its workers)."""
        started: list[subprocess.Popen] = []
        spawned = threading.Event()

        def run() -> None:
            try:
                started.append(self._spawn(spec))
            finally:
                spawned.set()
            if started:
                self._watch(spec.rank, started[0])

        threading.Thread(target=run, daemon=True, name=f"tp-worker-{spec.rank}").start()
        spawned.wait()
        if not started:
            raise WorkerLost(f"could not start {self.kind} worker rank {spec.rank}")
        return started[0]

    def _spawn(self, spec: WorkerSpec) -> subprocess.Popen:
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), NUMBA_NUM_THREADS=str(self.threads))
        cmd = [sys.executable, "-m", "pdserve.executor.worker", msgspec.json.encode(spec).decode()]
        fds = (self._kv_fd, self._payload_fd) + tuple(fd for fd in (spec.collectives_fd, spec.state_fd) if fd >= 0)
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env, pass_fds=fds, preexec_fn=_die_with_parent)

    def wait_ready(self) -> None:
        """Block until every worker has built its shard (or fail if one died trying)."""
        self._wait_for("ready")

    def _wait_for(self, stage: str) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        keys = [f"{stage}/{r}" for r in range(1, self.size)]
        while not self._store.check(keys):
            self.raise_if_lost()
            if time.monotonic() > deadline:
                raise WorkerLost(f"{self.kind} workers not {stage} after {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def send(self, plan: StepPlan, flat: torch.Tensor) -> None:
        """This step's inputs to every worker: the arrays (shared memory), then the plan."""
        self.raise_if_lost()
        if plan.in_shm:
            self.channel.write(flat.numpy(), plan.payload_offset)
        try:
            for proc in self.workers:
                write_message(proc.stdin.fileno(), plan)
        except OSError as exc:
            raise WorkerLost(f"a {self.kind} worker is gone: {exc}") from None
        if not plan.in_shm:
            self.channel.broadcast(flat)

    def map_states(self, layers: list[StateLayer], num_slots: int, slot_nbytes: int) -> torch.Tensor:
        """The recurrent-state arena ([num_slots, slot_nbytes] bytes, zeros) in shared memory, mapped
        here and by every worker (before its next step)."""
        if self._state_fd < 0:
            raise RuntimeError("this executor was started without a state arena (states=False)")
        os.ftruncate(self._state_fd, num_slots * slot_nbytes)
        arena = map_shared(fd_path(self._state_fd), [num_slots, slot_nbytes], torch.uint8)
        self._tell_workers(MapStates(num_slots, layers))
        return arena

    def _tell_workers(self, msg) -> None:
        try:
            for proc in self.workers:
                write_message(proc.stdin.fileno(), msg)
        except OSError as exc:
            raise WorkerLost(f"a {self.kind} worker is gone: {exc}") from None

    def load_lora(self, slot: int, name: str, path: str) -> None:
        """Every worker loads its slice of the adapter at path into slot (before the next step,
        which its pipe delivers after this)."""
        self._tell_workers(LoadLoRA(slot, name, path))

    def worker_waits(self) -> list[float]:
        """Seconds each worker (rank 1, 2, ...) has spent waiting for work: on its pipe between
        steps, and for the stage before's hidden states. Call between steps."""
        for proc in self.workers:
            write_message(proc.stdin.fileno(), ReportWaits())
        return [recv_waits(self.node_group.group, rank) for rank in range(1, self.size)]

    def raise_if_lost(self) -> None:
        if self.lost is not None:
            raise WorkerLost(self.lost)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self.closing.is_set():
            return
        self.lost = f"{self.kind} worker rank {rank} (pid {proc.pid}) exited with code {code}"
        log.error("%s; stopping the other workers", self.lost)
        _stop_workers(self.workers, grace_s=0.0)
        if EXIT_ON_WORKER_DEATH:
            log.error("the node exits: its owner restarts it")
            logging.shutdown()
            os._exit(WORKER_DEATH_EXIT_CODE)

    def close(self) -> None:
        if self.closing.is_set():
            return
        self.closing.set()
        for proc in self.workers:
            try:
                write_message(proc.stdin.fileno(), Shutdown())
            except (OSError, ValueError):
                pass
        self._finalizer()
        for fd in (self._kv_fd, self._payload_fd, *self._coll_fds, self._state_fd):
            if fd < 0:
                continue  # (no state arena: not a hybrid model)
            try:
                os.close(fd)
            except OSError:
                pass


def _close_workers(workers: list[subprocess.Popen], closing: threading.Event) -> None:
    """At close, collection or exit: the workers' exits from here on are expected."""
    closing.set()
    _stop_workers(workers)


def _stop_workers(workers: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """End of file on each worker's pipe (it exits between steps), then SIGKILL after grace_s."""
    for proc in workers:
        try:
            proc.stdin.close()
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace_s
    for proc in workers:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent goes (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
