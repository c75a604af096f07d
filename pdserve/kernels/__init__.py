"""Attention kernels: plain torch (CPU path) and Triton (GPU path, or CPU under TRITON_INTERPRET=1).

Every backend offers the same three ops with the same signatures; see torch_ops for the contract.
"""
from __future__ import annotations

import importlib
from types import ModuleType

BACKENDS = ("torch", "numba", "triton")


def get_ops(backend: str = "auto", device: str = "cpu") -> ModuleType:
    """The module holding store_kv, paged_decode_attention and prefill_attention."""
    if backend == "auto":
        if device.startswith("cuda"):
            backend = "triton" if _available("triton") else "torch"
        else:
            backend = "numba" if _available("numba") else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; supported: {', '.join(BACKENDS)}")
    return importlib.import_module(f"pdserve.kernels.{backend}_ops")


def _available(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def get_fused_layer_ops(ops: ModuleType, device: str) -> ModuleType | None:
    """The fused norm/RoPE/activation kernels that go with an attention backend, or None (the
    model then runs those ops in plain torch): Triton's on CUDA, numba's with the numba backend on
    CPU (float32; other dtypes run the plain torch ops through it)."""
    if ops.__name__ == "pdserve.kernels.triton_ops" and device.startswith("cuda"):
        return importlib.import_module("pdserve.kernels.triton_fused")
    if ops.__name__ == "pdserve.kernels.numba_ops" and device == "cpu":
        return importlib.import_module("pdserve.kernels.numba_fused")
    return None
