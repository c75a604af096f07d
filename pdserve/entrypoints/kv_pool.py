"""`pdserve serve --gpu-memory-utilization F`: vLLM's share of the GPU's memory, turned into
pdserve's KV pool size (--kv-cache-memory-gb) for every node.

vLLM gives one engine F of the GPU's memory, for its weights, activations and KV cache. A local
pdserve cluster runs every node's first rank on the first GPU (a TP node's rank r on GPU r), so
F of that GPU is shared by all its nodes: each node gets F / nodes of it, less its share of the
weights and a reserve for activations, CUDA graphs and the CUDA context; the rest is its KV pool.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.entrypoints.tp_degrees import node_degree
from pdserve.models.gguf import find_gguf_file
from pdserve.models.model_path import resolve_model_path

RESERVE_BYTES = 1 << 30  # activations, CUDA graphs and the CUDA context, per node
CPU_HINT = ("on CPU the KV pool is set in memory, not as a share of a GPU: --kv-cache-memory-gb GB "
            "(default 0.5) or --num-kv-blocks N")


def kv_pool_gb(fraction: float, total_bytes: int, weight_bytes: int, nodes: int, tp: int = 1) -> float:
    """Each node's KV pool in GiB: its share of `fraction` of the GPU, less its weights and reserve."""
    pool = fraction * total_bytes / max(1, nodes) - weight_bytes / tp - RESERVE_BYTES
    if pool <= 0:
        raise ValueError(f"{fraction} of the GPU's {total_bytes / 2**30:.1f} GiB, shared by {nodes} nodes, leaves "
                         f"no KV pool after the weights ({weight_bytes / 2**30:.2f} GiB a node, over {tp} ranks) "
                         "and 1 GiB for activations: raise it, or run fewer nodes")
    return pool / 2**30


def weight_bytes(model: str) -> int:
    """The checkpoint's weights as stored (safetensors or GGUF files)."""
    gguf = None if model.startswith("builtin:") else find_gguf_file(model)
    if gguf is not None:
        return gguf.stat().st_size
    path = Path(resolve_model_path(model))
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def kv_pool_from_utilization(args: argparse.Namespace, fraction: float) -> float:
    if not 0 < fraction <= 1:
        raise ValueError("a share of the GPU's memory, above 0 and at most 1")
    import torch  # heavy: only to read the GPU's size when the flag is given
    if not torch.cuda.is_available():
        raise ValueError(CPU_HINT)
    nodes = args.prefill_nodes + args.decode_nodes
    tp = min(node_degree(args, "decode", 0), node_degree(args, "prefill", 0) if args.prefill_nodes else 1 << 30)
    total = torch.cuda.get_device_properties(0).total_memory
    return kv_pool_gb(fraction, total, weight_bytes(args.model), nodes, tp)
