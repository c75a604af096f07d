"""Per-request recurrent state for hybrid models (Gated DeltaNet, Mamba2 layers): a pool of
slots beside the paged KV pool.

A linear-attention or Mamba layer keeps no per-token cache: it keeps, per request, a short
window of its convolution's last inputs and a fixed-size recurrent state. Each request holds one
slot from the time it is first scheduled until it finishes, is aborted or preempted; a slot
holds that request's window and state for every such layer. Slots are handed out and freed like
blocks (KVCacheManager takes and returns them with the request's blocks), and a slot is zeroed
when a request starts computing from its first token, so a recompute after preemption starts
from the same state as the first run.

The model declares what it needs (`state_spec()`: per stateful layer, the window's and the
state's shapes and dtypes); the model runner hands each step a `StateRows` naming every row
group's slot.

The pool is one byte arena, slot-major: arena[slot] holds every layer's window and state, each
a view at a fixed offset. So one slot is one contiguous byte range, as one KV block is: one NIXL
region and one store value when a prefill node hands a request's state over with its blocks
(pdserve.node.producers), and one row copy for a prefix-cache snapshot.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import xxhash

from pdserve.models.state_layers import LayerStateSpec

ALIGN = 64  # each tensor in a slot starts on a cache line (and any dtype's alignment)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def slot_offsets(spec: list[LayerStateSpec]) -> tuple[int, list[tuple[int, int]]]:
    """One slot's bytes, and each layer's (window, state) byte offsets in it."""
    offsets, at = [], 0
    for layer in spec:
        conv = at
        at += -(-math.prod(layer.conv_shape) * _itemsize(layer.conv_dtype) // ALIGN) * ALIGN
        offsets.append((conv, at))
        at += -(-math.prod(layer.state_shape) * _itemsize(layer.state_dtype) // ALIGN) * ALIGN
    return max(at, ALIGN), offsets


def slot_nbytes(spec: list[LayerStateSpec]) -> int:
    """One request's state over every stateful layer, in bytes (as the arena lays it out)."""
    return slot_offsets(spec)[0]


def state_layout(spec: list[LayerStateSpec]) -> str:
    """Names the bytes of a slot (every layer's shapes, dtypes and offsets): two nodes hand a
    state over only when theirs are equal (the handshake, KVCompat), and it salts the state's
    store keys (pdserve.protocol.block_keys.state_key)."""
    parts = [f"{s.conv_shape}{s.conv_dtype}{s.state_shape}{s.state_dtype}" for s in spec]
    described = f"pdserve-state-v1|{slot_offsets(spec)}|" + "|".join(parts)
    return f"state-v1-{len(spec)}-{xxhash.xxh3_64_hexdigest(described.encode())}"


def _view(arena: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    nbytes = math.prod(shape) * _itemsize(dtype)
    return arena[:, offset:offset + nbytes].view(dtype).unflatten(1, shape)


class StatePool:
    def __init__(self, spec: list[LayerStateSpec], num_slots: int, device: torch.device,
                 arena: torch.Tensor | None = None):
        """arena: the [num_slots, slot_nbytes] bytes to use (a tensor-parallel node's shared memory,
        which every rank maps: pdserve.executor), else zeros of this process's own."""
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        self.spec = spec
        self.slot_nbytes, offsets = slot_offsets(spec)
        self.layout = state_layout(spec)
        if arena is not None and tuple(arena.shape) != (num_slots, self.slot_nbytes):
            raise ValueError(f"a state arena of shape {tuple(arena.shape)} for {num_slots} slots of {self.slot_nbytes} bytes")
        self.arena = (torch.zeros((num_slots, self.slot_nbytes), dtype=torch.uint8, device=device)
                      if arena is None else arena)
        self.conv = [_view(self.arena, c, s.conv_shape, s.conv_dtype) for s, (c, _) in zip(spec, offsets)]
        self.state = [_view(self.arena, o, s.state_shape, s.state_dtype) for s, (_, o) in zip(spec, offsets)]
        self.free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.num_slots = num_slots

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def allocate(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def free(self, slot: int) -> None:
        assert slot not in self.free_slots, f"state slot {slot} freed twice"
        self.free_slots.append(slot)

    def num_in_use(self) -> int:
        return self.num_slots - len(self.free_slots)

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the slots of requests that start from their first token."""
        self.arena[slots] = 0


@dataclass
class StateRows:
    """A step's view of the pool, in the order of the step's rows: the first num_decodes rows
    are one-token queries (slots[:num_decodes], one each); then each prefill chunk's rows
    (spans: (slot, first row, end row))."""
    pool: StatePool
    slots: torch.Tensor  # [num_decodes] int64
    num_decodes: int
    spans: list[tuple[int, int, int]]


def step_rows(pool: StatePool, items, num_decode_rows: int, device: torch.device) -> StateRows:
    """items: (request, new tokens) in row order, the num_decode_rows one-token queries first.
    Zeroes the slots of requests computing their first token this step."""
    fresh = [r.state_slot for r, _ in items if r.num_computed_tokens == 0]
    if fresh:
        pool.reset(torch.tensor(fresh, dtype=torch.int64, device=device))
    decodes = [r.state_slot for r, _ in items[:num_decode_rows]]
    spans, row = [], num_decode_rows
    for req, n in items[num_decode_rows:]:
        spans.append((req.state_slot, row, row + n))
        row += n
    return StateRows(pool, torch.tensor(decodes, dtype=torch.int64, device=device), num_decode_rows, spans)
