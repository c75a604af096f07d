"""The paged KV pool's size when the operator sets none (no --kv-cache-memory-gb or
--num-kv-blocks): a share of the memory the machine has available at start, split among the
nodes `pdserve up` runs on it, within a floor and a cap, and never more blocks than the longest
requests could fill at the batch's size.

vLLM sizes its pool the same way on a GPU (a share of the device's memory). A fixed 0.5 GB held
about 35 concurrent requests of a few hundred tokens on the default model, so a server at 32
streams stalled on KV room long before it ran out of memory. The pool is allocated lazily on CPU
(pdserve.assembly.build), so its pages cost memory only once blocks are written."""
from __future__ import annotations

import math
import os

KV_MEMORY_SHARE = 0.6  # of MemAvailable at start, for the KV pools of all nodes on the machine
KV_POOL_FLOOR_GB = 0.5
KV_POOL_CAP_GB = 64.0
# Set by `pdserve up` in each node's environment: the nodes that share this machine's memory.
HOST_NODES_ENV = "PDSERVE_HOST_NODES"


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_nodes() -> int:
    try:
        return max(1, int(os.environ.get(HOST_NODES_ENV, "1")))
    except ValueError:
        return 1


def default_kv_pool_gb(nodes: int | None = None, available: int | None = None) -> float:
    """One node's KV pool in GiB: KV_MEMORY_SHARE of the available memory over `nodes` (default:
    HOST_NODES_ENV, else 1), within [KV_POOL_FLOOR_GB, KV_POOL_CAP_GB]."""
    available = available_memory_bytes() if available is None else available
    if not available:
        return KV_POOL_FLOOR_GB
    share = KV_MEMORY_SHARE * available / (nodes or host_nodes()) / 2**30
    return min(KV_POOL_CAP_GB, max(KV_POOL_FLOOR_GB, share))


def default_num_blocks(block_bytes: int, block_size: int, max_num_seqs: int, max_len: int,
                       nodes: int | None = None, available: int | None = None) -> int:
    """Blocks for the default pool: default_kv_pool_gb's worth, but no more than max_num_seqs
    requests of max_len tokens fill (a tiny model would otherwise get millions of blocks)."""
    by_memory = int(default_kv_pool_gb(nodes, available) * 2**30 // block_bytes)
    return max(1, min(by_memory, max_num_seqs * math.ceil(max_len / block_size)))
