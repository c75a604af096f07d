"""How pipeline stages hand a step on: tensors only, point to point over torch.distributed (a
gloo group of every rank of the node), never pickle.

Rank r is tensor-parallel rank r % tp of stage r // tp; the node process (rank 0) is stage 0's
first rank. Each rank of stage s sends its step's hidden states [tokens, hidden] to the rank of
stage s + 1 with the same TP rank (a stage's TP ranks all hold the whole hidden state after the
layer's all-reduce). The last stage's first rank sends the step's results (the logit rows the
driver samples from, or the final hidden states) back to rank 0. Every shape follows from the
StepPlan that every rank got, so no shape travels.
"""
from __future__ import annotations

import dataclasses
import time

import torch

HIDDEN_TAG = 1
RESULT_TAG = 2
WAITS_TAG = 3


@dataclasses.dataclass(frozen=True)
class StageRole:
    rank: int
    tp_size: int
    pp_size: int

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp_size - 1

    @property
    def result_rank(self) -> int:
        """The rank that sends the step's results to the driver: the last stage's first."""
        return (self.pp_size - 1) * self.tp_size


class StageLink:
    """One rank's sends and receives between stages. wait_seconds: time blocked in a receive
    (a stage idling for its input, or the driver for the step's results)."""

    def __init__(self, group, role: StageRole, hidden_size: int, dtype: torch.dtype):
        self.group, self.role = group, role
        self.hidden_size, self.dtype = hidden_size, dtype  # of the hidden states between stages
        self.wait_seconds = 0.0

    def send_hidden(self, hidden: torch.Tensor, wait: bool = True) -> PendingSend | None:
        """wait=False: returns the send at once, to be waited on later. A gloo send completes
        only once the peer posts its receive, so a driver with several micro-batches in flight
        must not wait on one before it has posted the receives of the results."""
        hidden = hidden.contiguous()
        work = self.group.send([hidden], self.role.rank + self.role.tp_size, HIDDEN_TAG)
        if wait:
            work.wait()
            return None
        return PendingSend(work, hidden)

    def recv_hidden(self, num_tokens: int) -> torch.Tensor:
        return self._recv((num_tokens, self.hidden_size), self.dtype, self.role.rank - self.role.tp_size, HIDDEN_TAG)

    def send_result(self, result: torch.Tensor) -> None:
        self.group.send([_nonempty(result.contiguous())], 0, RESULT_TAG).wait()

    def post_result(self, shape: tuple[int, ...], dtype: torch.dtype) -> PostedResult:
        """Post the receive of a step's results now; PostedResult.wait() gives them."""
        out = torch.empty(_nonempty_shape(shape), dtype=dtype)
        work = self.group.recv([out], self.role.result_rank, RESULT_TAG)
        return PostedResult(self, work, out, tuple(shape))

    def recv_result(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.post_result(shape, dtype).wait()

    def _recv(self, shape, dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        started = time.perf_counter()
        self.group.recv([out], src, tag).wait()
        self.wait_seconds += time.perf_counter() - started
        return out


@dataclasses.dataclass
class PendingSend:
    work: object
    tensor: torch.Tensor  # kept alive until the send is done

    def wait(self) -> None:
        self.work.wait()


@dataclasses.dataclass
class PostedResult:
    link: StageLink
    work: object
    out: torch.Tensor
    shape: tuple[int, ...]

    def wait(self) -> torch.Tensor:
        started = time.perf_counter()
        self.work.wait()
        self.link.wait_seconds += time.perf_counter() - started
        return self.out if _numel(self.shape) else torch.empty(self.shape, dtype=self.out.dtype)


def send_waits(group, seconds: float) -> None:
    """A worker's seconds spent waiting for work, to rank 0 (executor.worker_waits)."""
    group.send([torch.tensor([seconds], dtype=torch.float64)], 0, WAITS_TAG).wait()


def recv_waits(group, rank: int) -> float:
    out = torch.zeros(1, dtype=torch.float64)
    group.recv([out], rank, WAITS_TAG).wait()
    return float(out[0])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _nonempty_shape(shape) -> tuple[int, ...]:
    # A step with nothing to send back still sends one element: the driver waits for the step
    # to end on every stage before it writes the next step's inputs into the shared buffer.
    return tuple(shape) if _numel(shape) else (1,)


def _nonempty(t: torch.Tensor) -> torch.Tensor:
    return t if t.numel() else torch.zeros(1, dtype=t.dtype)
