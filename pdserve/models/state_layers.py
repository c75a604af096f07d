"""What a hybrid model's stateful layers (linear attention, Mamba) declare about the per-request
state they keep, so the engine can size and allocate its state pool (pdserve.engine.state_pool)
without knowing the layers."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerStateSpec:
    """One stateful layer's per-request tensors: the convolution window and the recurrent state."""
    conv_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    state_shape: tuple[int, ...]
    state_dtype: torch.dtype

    def nbytes(self) -> int:
        return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                   for shape, dtype in ((self.conv_shape, self.conv_dtype), (self.state_shape, self.state_dtype)))


def state_dtype(config, default: torch.dtype = torch.float32) -> torch.dtype:
    """The recurrent state's dtype: the config's mamba_ssm_cache_dtype where it names one, else
    float32 (the state accumulates over the whole sequence; a narrow type drifts)."""
    name = getattr(config, "mamba_ssm_cache_dtype", None)
    if name in (None, "auto"):
        return default
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"mamba_ssm_cache_dtype {name!r} is not supported; supported: {', '.join(dtypes)}")
    return dtypes[name]
