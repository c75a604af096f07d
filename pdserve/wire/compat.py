"""What a node's KV is, as its pongs report it, and which pairs of nodes may hand KV over.

A prefill node's blocks are only correct on a decode node that would have computed the same
bytes: the same weights, compute dtype, KV dtype, block size and cache layout, and the same KV
shape (layers, KV heads, head dim, or an MLA latent); for a hybrid model, also the same
recurrent-state slot (layers, shapes, dtypes), which travels with the blocks. A handover between nodes that differ in
any of these could stream wrong text with no error, so the router refuses to pair them
(pdserve.router.dispatch.compat_gate).

What is reported but never refused, because the handover bridges it:
- tensor and pipeline parallel degrees: every node's cache holds every layer and KV head in one
  block-major tensor, the layout of TP 1 (see tensor-parallelism.md), so any two degrees pair;
- the speculative config: speculation runs on the decode node only, over the target's KV (a
  draft recomputes its own), so the KV that crosses does not depend on it.
LoRA adapters are compared by name: two nodes may serve different sets (an adapter loaded while
one was down arrives later), but an adapter of one name must have the same weights on both.
"""
from __future__ import annotations

import msgspec

# The cache layout whose blocks a handover moves: [blocks, layers, planes, block, kv heads, head
# dim], every head and layer in the node's one tensor. A node with another layout (a cache per
# rank, say) must say so here, and then pairs only with its kind.
WHOLE_BLOCK_MAJOR = "block-major-whole-v1"


class KVCompat(msgspec.Struct, frozen=True):
    model_digest: str                # the weights and config.json, hashed (not the path)
    dtype: str                       # what the model computes in
    kv_dtype: str                    # what the cache stores
    block_size: int
    kv_planes: int                   # 2: K and V per KV head; 1: one MLA latent per token
    num_layers: int
    num_kv_heads: int
    head_dim: int
    cache_layout: str = WHOLE_BLOCK_MAJOR
    tensor_parallel_size: int = 1    # reported, bridged
    pipeline_parallel_size: int = 1  # reported, bridged
    speculative: str = ""            # reported, bridged ("": none)
    loras: dict[str, str] = {}       # adapter name -> digest of its files
    state_layout: str = ""           # a hybrid model's recurrent-state slot (handed over with the blocks); "": none

    def kv_key(self) -> tuple:
        """What must be equal for two nodes' KV to be the same bytes."""
        return (self.model_digest, self.dtype, self.kv_dtype, self.block_size, self.kv_planes,
                self.num_layers, self.num_kv_heads, self.head_dim, self.cache_layout, self.state_layout)

    def describe(self) -> str:
        shape = (f"MLA latent {self.head_dim}" if self.kv_planes == 1
                 else f"{self.num_kv_heads} KV heads x {self.head_dim}")
        return (f"model {self.model_digest[:12]}, dtype {self.dtype}, KV dtype {self.kv_dtype}, block size "
                f"{self.block_size}, {self.num_layers} layers, {shape}, layout {self.cache_layout}")


_KV_FIELDS = (("model_digest", "model weights"), ("dtype", "dtype"), ("kv_dtype", "KV cache dtype"),
              ("block_size", "block size"), ("kv_planes", "KV planes (K/V or MLA latent)"),
              ("num_layers", "layers"), ("num_kv_heads", "KV heads"), ("head_dim", "head dim"),
              ("cache_layout", "cache layout"), ("state_layout", "recurrent-state layout"))


def compat_mismatch(ours: KVCompat, theirs: KVCompat) -> str | None:
    """Why a node reporting `theirs` must not pair with one reporting `ours`; None: they may."""
    for name, label in _KV_FIELDS:
        a, b = getattr(ours, name), getattr(theirs, name)
        if a != b:
            return f"{label}: {b!r}, where the cluster's nodes have {a!r}"
    for adapter, digest in theirs.loras.items():
        if ours.loras.get(adapter, digest) != digest:
            return f"LoRA adapter {adapter!r} has other weights than the cluster's adapter of that name"
    return None
