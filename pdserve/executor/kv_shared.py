"""The node's paged KV cache in shared memory, with every KV head (the layout of TP 1), and
each rank's view of its own heads.

Why one cache with all heads rather than one cache per rank: the node process (the driver)
stores, loads and hands over whole blocks exactly as at TP 1, so block bytes, block keys and the
KV salt do not depend on the TP degree, the store and NIXL code are unchanged, and a prefix
stored by a TP 2 node is a cache hit for a TP 1 node and back. Each rank writes and reads only
its KV heads' slice; a KV head replicated on several ranks (fewer KV heads than ranks) is
written by each replica with identical bytes (same inputs, same weights, same kernel).
"""
from __future__ import annotations

import logging
import os
import time
import uuid

import torch

from pdserve.executor.messages import StateLayer
from pdserve.models.state_layers import LayerStateSpec

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


def create_shared_file(nbytes: int, prefix: str) -> int:
    """An open descriptor of nbytes zeros in shared memory (sparse until written), with no name
    left anywhere: a memfd (not bounded by /dev/shm's size, which is 64 MiB in a default Docker
    container), else a file in /dev/shm unlinked at once. It lives while a process holds it open
    or mapped, so nothing is left behind whatever dies first. Workers inherit the descriptor
    (pass_fds)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(f"pdserve-{prefix}", 0)  # no MFD_CLOEXEC: pass_fds hands it on
    else:
        path = os.path.join(SHM_DIR or "/tmp", f"pdserve-{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)
    os.ftruncate(fd, max(nbytes, 1))
    return fd


def allocate_shared_file(fd: int, nbytes: int) -> None:
    """Every page of the file allocated now (--kv-cache-prefault at TP or PP > 1): the kernel
    zeroes a shared-memory page once, for whichever rank writes it first, so a pool allocated here
    costs no step a first write; the ranks' mappings then take only the page-table entries."""
    start = time.perf_counter()
    os.posix_fallocate(fd, 0, nbytes)
    log.info("KV pool: %.2f GiB allocated at start in %.1f s (shared by the ranks)", nbytes / 2**30,
             time.perf_counter() - start)


def fd_path(fd: int, pid: int | None = None) -> str:
    """A path that opens the (unlinked) file behind descriptor fd of process pid (default: this one)."""
    return f"/proc/{pid or 'self'}/fd/{fd}"


def map_shared(path: str, shape: list[int] | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The file as a tensor whose writes every process mapping it sees (MAP_SHARED)."""
    numel = 1
    for d in shape:
        numel *= d
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(*shape)


def kv_head_range(total_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(first KV head, count) that `rank` computes, as QKVParallelLinear splits them: a
    contiguous share each, or one head replicated on tp_size // total_kv_heads ranks."""
    if total_kv_heads >= tp_size:
        count = total_kv_heads // tp_size
        return rank * count, count
    return rank // (tp_size // total_kv_heads), 1


def rank_layer_caches(kv_cache: torch.Tensor, heads: tuple[int, int] | None
                      ) -> list[tuple[torch.Tensor, ...]]:
    """Per layer, one view per plane ([blocks, block_size, kv_heads, head_dim]: K and V, or the
    MLA latent), cut to `heads` (first, count); None: every head (a replicated latent cache).
    The views are strided; the kernels address them through their strides."""
    caches = []
    for layer in range(kv_cache.shape[1]):
        planes = kv_cache[:, layer].unbind(1)
        if heads is not None:
            planes = tuple(p.narrow(2, heads[0], heads[1]) for p in planes)
        caches.append(tuple(planes))
    return caches


def state_layers(spec: list[LayerStateSpec]) -> list[StateLayer]:
    """A hybrid model's state spec as the workers' MapStates message carries it."""
    name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    return [StateLayer(list(s.conv_shape), name(s.conv_dtype), list(s.state_shape), name(s.state_dtype)) for s in spec]


def layer_specs(layers: list[StateLayer]) -> list[LayerStateSpec]:
    return [LayerStateSpec(tuple(s.conv_shape), getattr(torch, s.conv_dtype), tuple(s.state_shape),
                           getattr(torch, s.state_dtype)) for s in layers]
