"""Loading Hugging Face checkpoints into pdserve's fused modules, for the model families with a
module of their own (MoE, Gemma 3, gpt-oss).

pdserve fuses q/k/v into qkv_proj and gate/up into gate_up_proj, and stacks experts into
[E, ...] tensors; the checkpoint keeps them apart. WeightLoader copies each tensor into its
slice and counts the elements written, so a missing weight (or half of a fused one) is caught
whatever the model's layout.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pdserve.models.gguf import VIEW_MARKER, gguf_tensors

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_PART = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


class WeightLoader:
    def __init__(self, model: nn.Module, shard_sizes: Callable[[str], list[int]]):
        """shard_sizes(fused parameter name) -> row counts of its parts (q, k, v or gate, up)."""
        self.params = dict(model.named_parameters())
        self.written = dict.fromkeys(self.params, 0)
        self.shard_sizes = shard_sizes

    def copy(self, name: str, tensor: torch.Tensor, index: tuple = ()) -> None:
        if name not in self.params:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        target = self.params[name].data[index] if index else self.params[name].data
        if target.shape != tensor.shape:
            raise ValueError(f"weight {name}{list(index) if index else ''}: checkpoint shape "
                             f"{tuple(tensor.shape)}, model expects {tuple(target.shape)}")
        target.copy_(tensor)
        self.written[name] += tensor.numel()

    def copy_standard(self, name: str, tensor: torch.Tensor) -> None:
        """A parameter of the same name, or one part of a fused qkv/gate_up/expert tensor."""
        expert = _EXPERT.match(name)
        if expert:
            base, e, part = expert.group(1), int(expert.group(2)), expert.group(3)
            if part == "down_proj":
                self.copy(f"{base}.down_proj", tensor, (e,))
            else:
                rows = self.params[f"{base}.gate_up_proj"].shape[1] // 2
                start = 0 if part == "gate_proj" else rows
                self.copy(f"{base}.gate_up_proj", tensor, (e, slice(start, start + rows)))
            return
        fused = _FUSED_PART.match(name)
        if fused:
            base, part, kind = fused.groups()
            target = f"{base}.{'qkv_proj' if part[0] in 'qkv' else 'gate_up_proj'}.{kind}"
            order = ["q_proj", "k_proj", "v_proj"] if part[0] in "qkv" else ["gate_proj", "up_proj"]
            sizes = self.shard_sizes(target)
            start = sum(sizes[:order.index(part)])
            self.copy(target, tensor, (slice(start, start + sizes[order.index(part)]),))
            return
        self.copy(name, tensor)

    def check_complete(self, tied: tuple[str, ...] = ()) -> None:
        missing = [n for n, p in self.params.items() if self.written[n] < p.numel() and n not in tied]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))


def checkpoint_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name without the leading 'model.', tensor) for every tensor of the checkpoint."""
    for file in files:
        if file.name == VIEW_MARKER:  # a GGUF checkpoint: its weights, named as Hugging Face's
            for name, tensor in gguf_tensors(file.parent):
                yield name.removeprefix("model."), tensor
            continue
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name.removeprefix("model."), f.get_tensor(name)


def check_fields(config, allowed: dict[str, tuple]) -> None:
    """Refuse a config field whose value pdserve does not implement: allowed maps field ->
    accepted values (a missing field counts as its first accepted value)."""
    for field, accepted in allowed.items():
        value = getattr(config, field, accepted[0])
        if value not in accepted:
            raise ValueError(f"{type(config).__name__}.{field} = {value!r} is not supported "
                             f"(supported: {', '.join(repr(a) for a in accepted)})")
