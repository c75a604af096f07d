"""How a step's input arrays reach the workers, once per step.

The StepPlan (a few hundred bytes) goes down each worker's pipe, which also wakes it. The arrays
(token ids, positions, slots, context lengths, block tables: int64, flat) go either

- through shared memory: the driver writes them into a buffer every rank maps, before it sends
  the plan (the default: see docs/tensor-parallelism.md for the figures), or
- by a torch.distributed broadcast from rank 0, where they do not fit the buffer (or when
  PDSERVE_TP_STEP_INPUTS=broadcast, for measuring).

Reuse of the buffer is safe: the driver writes step k+1 only after step k ended, and a step ends
with a collective (the last layer's all-reduce, the LM head's gather) that every worker reaches
only after it copied its inputs out; with pipeline stages, with the last stage's results, which
it sends after every stage copied its inputs (each stage copies before it hands on). The
micro-batches of one step go to regions of their own (StepPlan.payload_offset).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from pdserve.executor.kv_shared import map_shared
from pdserve.executor.messages import StepPlan
from pdserve.layers.parallel import TPGroup

DEFAULT_CAPACITY = 1 << 20  # int64 elements (8 MiB, touched only as far as used)


def use_shared_memory() -> bool:
    return os.environ.get("PDSERVE_TP_STEP_INPUTS", "shm") != "broadcast"


def payload_length(plan: StepPlan) -> int:
    mrope = 3 * plan.num_tokens if plan.mrope_positions else 0
    return 3 * plan.num_tokens + sum(int(np.prod(s)) for s in plan.int32_shapes) + mrope + plan.image_rows


class StepChannel:
    """One rank's end: the driver sends, every worker receives."""

    def __init__(self, path: str, capacity: int, group: TPGroup):
        self.buffer = map_shared(path, [capacity], torch.int64)
        self.capacity, self.group = capacity, group
        self.shm = use_shared_memory()

    def fits(self, length: int) -> bool:
        return self.shm and length <= self.capacity

    def write(self, flat: np.ndarray, offset: int = 0) -> None:
        """Driver, before sending the plan: the arrays into shared memory."""
        self.buffer[offset: offset + flat.shape[0]].numpy()[:] = flat

    def broadcast(self, flat: torch.Tensor) -> None:
        """Driver, after sending the plan: the arrays to every worker."""
        _broadcast(self.group, flat)

    def receive(self, plan: StepPlan) -> torch.Tensor:
        """Worker: this step's flat arrays (its own copy)."""
        n = payload_length(plan)
        if plan.in_shm:
            return self.buffer[plan.payload_offset: plan.payload_offset + n].clone()
        flat = torch.empty(n, dtype=torch.int64)
        _broadcast(self.group, flat)
        return flat

    def broadcast_embeddings(self, values: torch.Tensor) -> None:
        """Driver, after the arrays: the step's image embeddings [R, hidden] (floats do not fit
        the int64 buffer; an image's rows are a few hundred kilobytes at most a step)."""
        _broadcast(self.group, values.contiguous())

    def receive_embeddings(self, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """Worker, after receive: the step's image embeddings."""
        values = torch.empty(rows, hidden, dtype=dtype)
        _broadcast(self.group, values)
        return values


def _broadcast(group: TPGroup, flat: torch.Tensor) -> None:
    # On the ProcessGroup itself: torch.distributed.broadcast wants a group registered with the
    # default group, and ours is standalone (see group.py).
    group.group.broadcast(flat, 0).wait()
