"""Linear layers that hold one tensor-parallel shard of their weights, in the format their
QuantMethod gives them (vLLM's LinearBase family, in small).

- ReplicatedLinear: every rank holds the whole matrix.
- ColumnParallelLinear: the output rows are split; each rank computes its slice of the output.
  MergedColumnParallelLinear fuses several such parts (gate and up), QKVParallelLinear fuses
  q, k and v and replicates KV heads when there are fewer of them than ranks.
- RowParallelLinear: the input columns are split; each rank's partial product is summed by one
  all-reduce. Column then row is one all-reduce per attention or MLP block.

Checkpoint tensors arrive whole, one part at a time, at `layer.weight_loader(name, tensor,
shard_id)`; the layer cuts this rank's slice. `layer.param_dims[name]` says which dimension of
each parameter holds output rows and which input columns (None where it has no such dimension),
so a quantized format's scales and packed weights load through the same code as a plain weight.
(The dims live on the layer, not on the Parameter: moving a module off the meta device makes new
Parameter objects.)

`layer.lora`, when set (pdserve.lora.slots), adds the step's LoRA adapters' low-rank products
to the layer's output, after its bias (as PEFT adds them to the base layer's output). At TP > 1
the adapters are cut as the weight is (`lora_shard`): a column-parallel layer's B by output
rows, a row-parallel layer's A by input columns, its partial deltas summed by the layer's
all-reduce (as vLLM's row-parallel LoRA layers do).
"""
from __future__ import annotations

import torch
from torch import nn

from pdserve.layers.parallel import divide, get_tp_group
from pdserve.layers.quant import QuantConfig, UnquantizedLinearMethod


class LinearBase(nn.Module):
    """A linear layer over one rank's shard: input_size columns, output_sizes rows in parts.
    `split_input` / `split_output` say which dimension the TP group splits."""

    split_input = False
    split_output = False

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 quant_config: QuantConfig | None = None, prefix: str = "",
                 params_dtype: torch.dtype | None = None):
        super().__init__()
        self.tp = get_tp_group()
        self.full_input_size, self.full_output_sizes = input_size, list(output_sizes)
        self.input_size = divide(input_size, self.tp.size, f"{prefix} input") if self.split_input else input_size
        self.output_sizes = self.local_output_sizes()
        self.param_dims: dict[str, tuple[int | None, int | None]] = {}
        dtype = params_dtype or torch.get_default_dtype()
        self.lora = None  # LoRA slot buffers (pdserve.lora.slots.LoRALayerSlots) when adapters are on
        self.quant_method = (quant_config.linear_method(self, prefix) if quant_config is not None
                             else UnquantizedLinearMethod())
        self.quant_method.create_weights(self, self.input_size, self.output_sizes, dtype)
        if bias:
            rows = sum(self.output_sizes)
            self.register_parameter("bias", nn.Parameter(torch.empty(rows, dtype=dtype), requires_grad=False))
            self.param_dims["bias"] = (0, None)
        else:
            self.register_parameter("bias", None)

    def local_output_sizes(self) -> list[int]:
        if not self.split_output:
            return list(self.full_output_sizes)
        return [divide(s, self.tp.size, "output rows") for s in self.full_output_sizes]

    def part_source_start(self, part: int) -> int:
        """Where this rank's rows of `part` start in the checkpoint's tensor of that part."""
        return self.tp.rank * self.output_sizes[part] if self.split_output else 0

    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """Copy this rank's slice of one checkpoint tensor (all of part shard_id of a fused layer,
        or all of an unfused one) into parameter `name`."""
        param = getattr(self, name)
        target = param.data
        output_dim, input_dim = self.param_dims[name]
        if output_dim is not None and (shard_id is not None or self.split_output):
            part = shard_id or 0
            rows = param.shape[output_dim] * self.output_sizes[part] // sum(self.output_sizes)
            offset = param.shape[output_dim] * sum(self.output_sizes[:part]) // sum(self.output_sizes)
            start = self.part_source_start(part) * rows // self.output_sizes[part]
            target = target.narrow(output_dim, offset, rows)
            loaded = loaded.narrow(output_dim, start, rows)
        if input_dim is not None and self.split_input:
            cols = param.shape[input_dim]
            loaded = loaded.narrow(input_dim, self.tp.rank * cols, cols)
        if target.shape != loaded.shape:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a parameter "
                             f"slice of shape {tuple(target.shape)}")
        target.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_lora(x, self.quant_method.apply(self, x, self.bias))

    def with_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y if self.lora is None else self.lora.add(x, y)

    def lora_shard(self, part: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of part `part`'s LoRA A [r, in] and B [out, r], cut as the base
        weight is: B by this rank's output rows (a replicated KV head's rows on each of its
        ranks), A by this rank's input columns."""
        if self.split_output:
            b = b.narrow(0, self.part_source_start(part), self.output_sizes[part])
        if self.split_input:
            a = a.narrow(1, self.tp.rank * self.input_size, self.input_size)
        return a, b

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_sizes}, tp={self.tp.rank}/{self.tp.size}, "
                f"method={type(self.quant_method).__name__}")


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, **kw):
        super().__init__(input_size, [output_size], bias, **kw)


class ColumnParallelLinear(LinearBase):
    split_output = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False, **kw):
        self.gather_output = gather_output
        super().__init__(input_size, [output_size], bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.tp.all_gather_last(y) if self.gather_output else y


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel layers in one matmul (gate and up): part i's rows of every rank
    sit side by side, so each rank's output splits into its own slices of each part."""
    split_output = True

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, **kw):
        super().__init__(input_size, output_sizes, bias, **kw)


class QKVParallelLinear(LinearBase):
    """q, k and v in one matmul, split by heads. With fewer KV heads than ranks each KV head is
    replicated on tp_size // num_kv_heads ranks, as vLLM does."""
    split_output = True

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, **kw):
        tp = get_tp_group().size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads, self.kv_replicas = divide(num_kv_heads, tp, "KV heads"), 1
        else:
            self.num_kv_heads, self.kv_replicas = 1, divide(tp, num_kv_heads, "ranks per KV head")
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, **kw)

    def local_output_sizes(self) -> list[int]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [q, kv, kv]

    def part_source_start(self, part: int) -> int:
        if part == 0:
            return self.tp.rank * self.output_sizes[0]
        return (self.tp.rank // self.kv_replicas) * self.output_sizes[part]


class RowParallelLinear(LinearBase):
    """Input columns split; partial products summed over ranks, then the bias added once."""
    split_input = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True, **kw):
        self.reduce_results = reduce_results
        super().__init__(input_size, [output_size], bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.with_lora(x, self.quant_method.apply(self, x, self.bias))
        # Each rank's LoRA delta uses its input columns of A, so it is a partial sum like the
        # base product: both are summed by the one all-reduce (no collective of its own).
        y = self.with_lora(x, self.quant_method.apply(self, x, None))
        if self.reduce_results:
            y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y
