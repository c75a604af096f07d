"""Checkpoint tensors into a model built from pdserve.layers: each tensor goes to the layer that
owns it, which cuts its tensor-parallel slice (and, for a quantized layer, its format's parts)."""
from __future__ import annotations

import torch
from torch import nn


def load_param(model: nn.Module, name: str, tensor: torch.Tensor, shard_id: int | None = None) -> None:
    """Load the checkpoint tensor for parameter `name` (part shard_id of a fused one). Layers with
    a weight_loader slice it; any other parameter (norms, sinks) is replicated and copied whole."""
    module_path, _, attr = name.rpartition(".")
    module = model.get_submodule(module_path)
    loader = getattr(module, "weight_loader", None)
    if loader is not None:
        loader(attr, tensor, shard_id)
        return
    param = getattr(module, attr)
    if param.shape != tensor.shape:
        raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}")
    param.data.copy_(tensor)


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer's quant method repack what was loaded into its kernel's layout."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def materialize(model: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """Module.to_empty(device=...) for a model built on the meta device: the same uninitialised
    tensors (shapes, strides, dtypes), made with empty_strided. to_empty calls empty_like on the
    meta tensors, which runs torch's Python reference and its first call imports
    torch.fx.experimental.symbolic_shapes and sympy: about 0.4 s of CPU in every node, worker
    and offline engine that loads a model."""
    return model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))
