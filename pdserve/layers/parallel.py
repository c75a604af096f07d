"""The tensor-parallel group a model's layers shard over and reduce through.

One process per rank. A model is built after `set_tp_group` (the executor's workers do it once at
start); layers read rank and size when they are constructed. Without a group every layer is a
plain single-device layer: size 1, and the collectives return their input.

Collectives go through torch.distributed, gloo on CPU and NCCL on CUDA, in one code path, and
carry tensors only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object = None  # a torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place on x (returned for chaining)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's x along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


_SINGLE = TPGroup()
_current: TPGroup = _SINGLE


def get_tp_group() -> TPGroup:
    return _current


def set_tp_group(group: TPGroup | None) -> None:
    global _current
    _current = group or _SINGLE


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator
