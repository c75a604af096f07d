"""What the vision towers (Qwen2.5-VL's, Gemma 3's) share: a spec's head size, and loading a
tower's weights from the checkpoint's tensors into a module built on the meta device."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from pdserve.models.weights import WeightLoader


class HeadDim:
    """A spec with hidden_size and num_heads (its dataclass fields) gets its head size."""

    hidden_size: int
    num_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def load_tower(build: Callable[[], nn.Module], part_sizes: list[int], tensors: Iterator[tuple[str, torch.Tensor]],
               dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """build() makes the module (on the meta device: no memory until its weights arrive);
    part_sizes: the rows of each part of its one fused parameter."""
    with torch.device("meta"):
        module = build()
    module = module.to_empty(device="cpu")
    loader = WeightLoader(module, lambda name: part_sizes)
    for name, tensor in tensors:
        loader.copy_standard(name, tensor)
    loader.check_complete()
    return module.to(device=device, dtype=dtype).eval()
