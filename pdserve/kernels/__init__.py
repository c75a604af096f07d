"""Attention kernels: plain torch (CPU path) and Triton (GPU path, or CPU under TRITON_INTERPRET=1).

Every backend offers the same three ops with the same signatures; see torch_ops for the contract.
"""
from __future__ import annotations

import importlib
from types import ModuleType

BACKENDS = ("torch", "triton")


def get_ops(backend: str = "auto", device: str = "cpu") -> ModuleType:
    """The module holding store_kv, paged_decode_attention and prefill_attention."""
    if backend == "auto":
        backend = "triton" if device.startswith("cuda") and _triton_available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; supported: {', '.join(BACKENDS)}")
    return importlib.import_module(f"pdserve.kernels.{backend}_ops")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
