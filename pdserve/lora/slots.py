"""Per-layer LoRA slot buffers and the batched products of one step.

Each adapted linear layer holds, for max_loras slots, A^T [in, parts * max_rank] and
B^T [parts * max_rank, out] (scaling folded in). The parts of a fused layer (q, k, v; gate, up)
share one shrink matmul: their A^T columns sit side by side, and B^T is block-diagonal, so part
i's rank columns write only part i's output columns. An adapter of rank r < max_rank fills the
first parts * r columns; the products use only those.

A step's tokens come in runs of one adapter (the model runner orders requests by adapter inside
the decodes and inside the prefills), so the products are one (shrink, expand) pair of matmuls
per run of an adapter, added in place into that run's rows of the base output: no per-request
loop, no gather. Tokens on the base model are in no run and cost nothing.
"""
from __future__ import annotations

import torch

from pdserve.lora.peft_format import MODULE_PARTS

# pdserve's fused Llama layer -> the PEFT module of each of its parts, in order.
LAYER_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoRABatch:
    """The current step's runs: (slot, first row, end row), shared by every layer's slots."""

    def __init__(self):
        self.runs: list[tuple[int, int, int]] = []

    def set_runs(self, slots_and_tokens: list[tuple[int | None, int]]) -> None:
        """From the step's requests in row order: (slot or None for the base model, tokens)."""
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


class LoRALayerSlots:
    def __init__(self, input_size: int, part_sizes: list[int], max_loras: int, max_rank: int,
                 batch: LoRABatch, dtype: torch.dtype, device: torch.device):
        self.part_sizes = list(part_sizes)
        self.max_rank, self.batch = max_rank, batch
        width = len(part_sizes) * max_rank
        self.a_t = torch.zeros(max_loras, input_size, width, dtype=dtype, device=device)
        self.b_t = torch.zeros(max_loras, width, sum(part_sizes), dtype=dtype, device=device)
        self.width = [0] * max_loras  # columns in use per slot: parts * the adapter's rank

    def load(self, slot: int, rank: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """parts[i]: part i's (A [r_i, in], scaled B [out_i, r_i]), or None where the adapter
        leaves that part alone. Every part gets `rank` columns (r_i <= rank; the rest zero)."""
        a_t, b_t = self.a_t[slot], self.b_t[slot]
        a_t.zero_()
        b_t.zero_()
        out = 0
        for i, (size, ab) in enumerate(zip(self.part_sizes, parts)):
            if ab is not None:
                a, b = ab
                col = i * rank
                a_t[:, col:col + a.shape[0]].copy_(a.t())
                b_t[col:col + a.shape[0], out:out + size].copy_(b.t())
            out += size
        self.width[slot] = len(self.part_sizes) * rank

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] += each run's x rows times its adapter's A^T B^T, in place."""
        for slot, start, end in self.batch.runs:
            w = self.width[slot]
            if w:
                h = torch.mm(x[start:end], self.a_t[slot, :, :w])
                y[start:end].addmm_(h, self.b_t[slot, :w])
        return y


def attach_slots(model, max_loras: int, max_rank: int, batch: LoRABatch, dtype: torch.dtype,
                 device: torch.device) -> dict[tuple[int, str], LoRALayerSlots]:
    """Give every adapted linear layer of a Llama-family model its slot buffers; returns them by
    (layer index, fused layer name)."""
    from pdserve.layers.linear import LinearBase
    found: dict[tuple[int, str], LoRALayerSlots] = {}
    for i, decoder_layer in enumerate(model.layers):
        for owner, layer_name in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"),
                                  ("mlp", "gate_up_proj"), ("mlp", "down_proj")):
            layer = getattr(getattr(decoder_layer, owner, None), layer_name, None)
            if not isinstance(layer, LinearBase):
                raise ValueError("LoRA adapters are supported for the Llama family (Llama, Mistral, Qwen2, "
                                 f"Qwen3) only; this model has no {owner}.{layer_name} linear layer")
            slots = LoRALayerSlots(layer.input_size, layer.output_sizes, max_loras, max_rank, batch,
                                   dtype, device)
            layer.lora = slots
            found[(i, layer_name)] = slots
    return found


def module_shapes(model) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in, out) of one part, for checking an adapter against the model."""
    layer0 = model.layers[0]
    shapes = {}
    for module, (layer_name, part) in MODULE_PARTS.items():
        owner = layer0.self_attn if layer_name in ("qkv_proj", "o_proj") else layer0.mlp
        layer = getattr(owner, layer_name)
        shapes[module] = (layer.input_size, layer.output_sizes[part])
    return shapes
