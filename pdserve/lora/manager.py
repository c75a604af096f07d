"""Which adapters a model serves and which sit in its slots.

- Registered adapters: name -> directory (lora_modules at start, add/remove at run time).
- Host copies: at most max_cpu_loras adapters' tensors in memory, least recently used dropped
  (read from the directory again when needed).
- Slots: max_loras adapters resident in the layers' slot buffers. A request holds its adapter's
  slot from the step it is scheduled until it finishes or is preempted; a slot no request
  holds is evicted least recently used when another adapter needs one. When every slot is held,
  acquire returns None and the request waits.

An adapter removed while requests still name it stays usable by them (its host copy is kept)
and is dropped when the last one ends; new requests cannot name it.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from pathlib import Path

import torch

from pdserve.lora.peft_format import LoRAWeights, read_peft_adapter
from pdserve.lora.slots import LAYER_PARTS, LoRABatch, LoRALayerSlots, attach_slots, module_shapes


class LoRAManager:
    def __init__(self, model, max_loras: int, max_rank: int, max_cpu_loras: int | None,
                 dtype: torch.dtype, device: torch.device):
        max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_rank}")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.max_rank, self.max_cpu_loras = max_rank, max_cpu_loras
        self.batch = LoRABatch(device)
        self.layers = attach_slots(model, max_loras, max_rank, self.batch, dtype, device)
        self.shapes = module_shapes(model)
        self.num_layers = len(model.layers)
        self.paths: dict[str, Path] = {}
        self.host: OrderedDict[str, LoRAWeights] = OrderedDict()
        self.refs: Counter[str] = Counter()  # engine requests naming each adapter
        self.retiring: set[str] = set()  # removed while requests still name them
        self.slot_names: list[str | None] = [None] * max_loras
        self.slot_users = [0] * max_loras
        self.slot_lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))
        self.slot_loads = 0  # adapters copied into a slot (a cost the router's routing avoids)
        # on_load(slot, name, path): at TP > 1, the workers load the adapter into the same slot
        # of their shards (pdserve.executor's LoadLoRA), before the step that uses it.
        self.on_load = None

    # ---- registry ------------------------------------------------------------------------
    def add(self, name: str, path: str | Path) -> None:
        """Register an adapter, reading and checking it now (ValueError if unusable)."""
        path = Path(path)
        if name in self.paths:
            if self.paths[name].resolve() == path.resolve():
                return
            raise ValueError(f"LoRA adapter {name!r} is already loaded from {self.paths[name]}")
        if name in self.retiring:
            raise ValueError(f"LoRA adapter {name!r} is being unloaded (requests still use it); retry later")
        weights = read_peft_adapter(name, path)
        self._check(weights)
        self.paths[name] = path
        self._keep_host(weights)

    def remove(self, name: str) -> bool:
        if self.paths.pop(name, None) is None:
            return False
        if self.refs[name]:
            self.retiring.add(name)
        else:
            self._drop(name)
        return True

    def names(self) -> list[str]:
        return list(self.paths)

    def resident(self) -> list[str]:
        return [n for n in self.slot_names if n is not None]

    def ref(self, name: str) -> None:
        """A request naming the adapter entered the engine."""
        if name not in self.paths:
            raise ValueError(f"unknown LoRA adapter {name!r}")
        self.refs[name] += 1

    def unref(self, name: str) -> None:
        self.refs[name] -= 1
        if self.refs[name] <= 0:
            del self.refs[name]
            if name in self.retiring:
                self.retiring.discard(name)
                self._drop(name)

    # ---- slots ---------------------------------------------------------------------------
    def acquire(self, name: str) -> int | None:
        """The slot holding the adapter (loaded now if need be), held until release; None when
        every slot is held by other adapters' requests."""
        slot = self.slot_names.index(name) if name in self.slot_names else self._evictable_slot()
        if slot is None:
            return None
        if self.slot_names[slot] != name:
            self._load(slot, name)
        self.slot_users[slot] += 1
        self.slot_lru.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        self.slot_users[slot] -= 1

    def _evictable_slot(self) -> int | None:
        for slot in self.slot_lru:  # least recently used first; empty slots were never used
            if self.slot_names[slot] is None:
                return slot
        return next((slot for slot in self.slot_lru if self.slot_users[slot] == 0), None)

    def _load(self, slot: int, name: str) -> None:
        weights = self._host_copy(name)
        fill_slot(self.layers, slot, weights)
        if self.on_load is not None:
            self.on_load(slot, weights.name, str(weights.path))
        self.slot_names[slot] = name
        self.slot_loads += 1

    # ---- host copies ---------------------------------------------------------------------
    def _host_copy(self, name: str) -> LoRAWeights:
        if name in self.host:
            self.host.move_to_end(name)
            return self.host[name]
        weights = read_peft_adapter(name, self.paths[name])
        self._keep_host(weights)
        return weights

    def _keep_host(self, weights: LoRAWeights) -> None:
        self.host[weights.name] = weights
        self.host.move_to_end(weights.name)
        extra = len(self.host) - self.max_cpu_loras
        evictable = [n for n in self.host if n not in self.retiring and n != weights.name]
        for name in evictable[:max(extra, 0)]:
            del self.host[name]

    def _drop(self, name: str) -> None:
        self.host.pop(name, None)
        if name in self.slot_names:
            self.slot_names[self.slot_names.index(name)] = None

    def _check(self, weights: LoRAWeights) -> None:
        if weights.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {weights.name!r} has rank {weights.rank}, above max_lora_rank "
                             f"{self.max_rank}; start with a larger --max-lora-rank")
        for (layer, module), (a, b) in weights.modules.items():
            in_size, out_size = self.shapes[module]
            if layer >= self.num_layers or a.shape[1] != in_size or b.shape[0] != out_size:
                raise ValueError(f"LoRA adapter {weights.name!r}: layers.{layer}.{module} of shapes "
                                 f"A {tuple(a.shape)}, B {tuple(b.shape)} does not fit this model "
                                 f"({self.num_layers} layers, {module} {in_size} -> {out_size})")


def fill_slot(layers: dict[tuple[int, str], LoRALayerSlots], slot: int, weights: LoRAWeights) -> None:
    """Copy an adapter into one slot of every adapted layer (each cuts its TP rank's slice)."""
    for (layer, layer_name), slots in layers.items():
        parts = [weights.modules.get((layer, module)) for module in LAYER_PARTS[layer_name]]
        slots.load(slot, weights.rank, parts)
