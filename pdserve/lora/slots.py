"""Per-layer LoRA slot buffers and the batched products of one step.

Each adapted linear layer holds, for max_loras slots, A^T [in, parts * max_rank] and
B^T [parts * max_rank, out] (scaling folded in). The parts of a fused layer (q, k, v; gate, up)
share one shrink matmul: their A^T columns sit side by side, and B^T is block-diagonal, so part
i's rank columns write only part i's output columns. An adapter of rank r < max_rank fills the
first parts * r columns; the products use only those.

A step's tokens come in runs of one adapter (the model runner orders requests by adapter inside
the decodes and inside the prefills). Two ways to apply them, no per-request loop either way:

- per run: one (shrink, expand) pair of matmuls per run of an adapter, added in place into that
  run's rows of the base output (no gather). Tokens on the base model cost nothing. A long run
  of a fused layer expands part by part (skipping parts the adapter leaves alone) rather than
  through the zeros of the block-diagonal B^T.
- stacked, for small steps (decode) with several runs: every slot's A^T side by side, so one
  matmul shrinks every token against every slot; a mask keeps each token's own slot's columns
  (exact zeros elsewhere), and one matmul expands against every slot's B^T stacked. max_loras
  times the products' FLOPs, but two matmuls per layer however many adapters the batch mixes.
"""
from __future__ import annotations

import torch

from pdserve.layers.linear import LinearBase
from pdserve.lora.peft_format import MODULE_PARTS
from pdserve.models.pipeline import MissingLayer

# pdserve's fused Llama layer -> the PEFT module of each of its parts, in order.
LAYER_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


# Steps of at most this many tokens with more than one run use the stacked products.
STACKED_MAX_TOKENS = 64


class LoRABatch:
    """The current step's runs: (slot, first row, end row), shared by every layer's slots; for a
    stacked step, each token's slot and the column masks built from it."""

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self.runs: list[tuple[int, int, int]] = []
        self.token_slots: torch.Tensor | None = None  # [T] for a stacked step (-1: the base model)
        self.step_rows: list[tuple[int, int]] = []
        self._masks: dict[int, torch.Tensor] = {}

    def set_runs(self, slots_and_tokens: list[tuple[int | None, int]]) -> None:
        """From the step's requests in row order: (slot or None for the base model, tokens)."""
        # As given, for a TP step's plan: the workers set the same runs (-1: the base model).
        self.step_rows = [(-1 if slot is None else slot, n) for slot, n in slots_and_tokens]
        runs: list[tuple[int, int, int]] = []
        row = 0
        for slot, n in slots_and_tokens:
            if slot is not None:
                if runs and runs[-1][0] == slot and runs[-1][2] == row:
                    runs[-1] = (slot, runs[-1][1], row + n)
                else:
                    runs.append((slot, row, row + n))
            row += n
        self.runs = runs
        self._masks = {}
        self.token_slots = None
        if len(runs) > 1 and row <= STACKED_MAX_TOKENS:
            self.token_slots = torch.tensor(self.row_slots(), device=self.device)

    def row_slots(self) -> list[int]:
        """The step's slot of each row, in row order (-1: the base model)."""
        return [slot for slot, n in self.step_rows for _ in range(n)]

    def mask(self, width: int, max_loras: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, max_loras * width]: 1 where the column belongs to the token's slot."""
        mask = self._masks.get(width)
        if mask is None:
            column_slot = torch.arange(max_loras * width, device=self.token_slots.device) // width
            mask = self._masks[width] = (self.token_slots[:, None] == column_slot[None, :]).to(dtype)
        return mask


class LoRALayerSlots:
    def __init__(self, input_size: int, part_sizes: list[int], max_loras: int, max_rank: int,
                 batch: LoRABatch, dtype: torch.dtype, device: torch.device, shard=None):
        self.part_sizes = list(part_sizes)
        # shard(part, A, B) -> this rank's (A, B) at TP > 1 (LinearBase.lora_shard); None: whole.
        self.shard = shard
        self.max_rank, self.batch, self.max_loras = max_rank, batch, max_loras
        self.stride = width = len(part_sizes) * max_rank  # columns per slot
        # Slot s: columns s * width.. of a_stack, rows s * width.. of b_stack.
        self.a_stack = torch.zeros(input_size, max_loras * width, dtype=dtype, device=device)
        self.b_stack = torch.zeros(max_loras * width, sum(part_sizes), dtype=dtype, device=device)
        self.rank = [0] * max_loras  # the adapter's rank per slot (its columns: parts * rank)
        self.targets: list[list[bool]] = [[False] * len(part_sizes) for _ in range(max_loras)]

    def load(self, slot: int, rank: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """parts[i]: part i's (A [r_i, in], scaled B [out_i, r_i]), or None where the adapter
        leaves that part alone. Every part gets `rank` columns (r_i <= rank; the rest zero)."""
        first = slot * self.stride
        a_t, b_t = self.a_stack[:, first:first + self.stride], self.b_stack[first:first + self.stride]
        a_t.zero_()
        b_t.zero_()
        out = 0
        for i, (size, ab) in enumerate(zip(self.part_sizes, parts)):
            if ab is not None:
                a, b = ab if self.shard is None else self.shard(i, *ab)
                col = i * rank
                a_t[:, col:col + a.shape[0]].copy_(a.t())
                b_t[col:col + a.shape[0], out:out + size].copy_(b.t())
            out += size
        self.rank[slot] = rank
        self.targets[slot] = [ab is not None for ab in parts]

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] += each token's x times its adapter's A^T B^T, in place."""
        batch = self.batch
        if batch.token_slots is not None:
            h = torch.mm(x, self.a_stack) * batch.mask(self.stride, self.max_loras, x.dtype)
            return y.addmm_(h, self.b_stack)
        for slot, start, end in batch.runs:
            rank, first = self.rank[slot], slot * self.stride
            if not rank:
                continue
            h = torch.mm(x[start:end], self.a_stack[:, first:first + len(self.part_sizes) * rank])
            if len(self.part_sizes) == 1 or end - start < STACKED_MAX_TOKENS:
                y[start:end].addmm_(h, self.b_stack[first:first + h.shape[1]])
                continue
            out = 0
            for i, size in enumerate(self.part_sizes):
                if self.targets[slot][i]:
                    rows = slice(first + i * rank, first + (i + 1) * rank)
                    y[start:end, out:out + size].addmm_(h[:, i * rank:(i + 1) * rank], self.b_stack[rows, out:out + size])
                out += size
        return y


def attach_slots(model, max_loras: int, max_rank: int, batch: LoRABatch, dtype: torch.dtype,
                 device: torch.device) -> dict[tuple[int, str], LoRALayerSlots]:
    """Give every adapted linear layer of a Llama-family model its slot buffers; returns them by
    (layer index, fused layer name)."""
    found: dict[tuple[int, str], LoRALayerSlots] = {}
    for i, decoder_layer in enumerate(model.layers):
        if isinstance(decoder_layer, MissingLayer):  # another pipeline stage's layer: its adapters are there
            continue
        for owner, layer_name in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"),
                                  ("mlp", "gate_up_proj"), ("mlp", "down_proj")):
            layer = getattr(getattr(decoder_layer, owner, None), layer_name, None)
            if not isinstance(layer, LinearBase):
                raise ValueError("LoRA adapters are supported for the Llama family (Llama, Mistral, Qwen2, "
                                 f"Qwen3) only; this model has no {owner}.{layer_name} linear layer")
            slots = LoRALayerSlots(layer.input_size, layer.output_sizes, max_loras, max_rank, batch,
                                   dtype, device, shard=layer.lora_shard if layer.tp.size > 1 else None)
            layer.lora = slots
            found[(i, layer_name)] = slots
    return found


def module_shapes(model) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in, out) of one part, for checking an adapter against the model (the
    whole layer's sizes: an adapter is read whole, then cut to a TP rank's slice)."""
    layer0 = model.layers[0]
    shapes = {}
    for module, (layer_name, part) in MODULE_PARTS.items():
        owner = layer0.self_attn if layer_name in ("qkv_proj", "o_proj") else layer0.mlp
        layer = getattr(owner, layer_name)
        shapes[module] = (layer.full_input_size, layer.full_output_sizes[part])
    return shapes
