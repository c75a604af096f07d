"""Block keys: the contract between router, prefill nodes, decode nodes and the KV store.

A key is xxh3-128 over (parent key, salt, the block's token ids as little-endian uint32). It
depends on nothing but those bytes, so every process on every machine computes the same chain.
This module imports no torch so the router can use it with only a tokenizer.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from pdserve.protocol.multimodal import ImageInput, block_extra

KEY_BYTES = 16
ROOT_KEY = b"\x00" * KEY_BYTES


def kv_layout_salt(model_name: str, num_layers: int, num_kv_heads: int, head_dim: int,
                   dtype: str, block_size: int, planes: int = 2) -> bytes:
    """Salt naming the model and KV layout, so caches of different models never collide.
    planes: 2 for K and V per KV head, 1 for one latent per token (MLA); see kv_entry_dims."""
    layout = "" if planes == 2 else f"|P{planes}"
    text = f"pdserve-kv-v1|{model_name}|L{num_layers}{layout}|H{num_kv_heads}|D{head_dim}|{dtype}|B{block_size}"
    return xxhash.xxh3_128_digest(text.encode())


def request_salt(layout_salt: bytes, cache_salt: str | None = None, adapter: str | None = None) -> bytes:
    """The salt of one request's block keys: the layout's, mixed with what must never share KV
    with other requests (a tenant's cache_salt, a LoRA adapter's name). Unchanged when neither is
    given, so plain requests keep today's keys. Length-prefixed parts: ("ab", None) never equals
    (None, "ab") or ("a", "b")."""
    if cache_salt is None and adapter is None:
        return layout_salt
    parts = [b"pdserve-request-salt-v1", layout_salt]
    for tag, value in ((b"T", cache_salt), (b"A", adapter)):
        raw = b"" if value is None else value.encode()
        parts.append(tag + (b"-" if value is None else struct.pack("<I", len(raw)) + raw))
    return xxhash.xxh3_128_digest(b"|".join(parts))


def kv_entry_dims(hf_config) -> tuple[int, int, int]:
    """(planes, heads, dim) of one token's cache entry in one layer, from a transformers config.

    - K/V per KV head: (2, num_key_value_heads, head_dim).
    - Multi-head latent attention (a config with kv_lora_rank): (1, 1, kv_lora_rank +
      qk_rope_head_dim), the compressed latent that all heads share.
    The engine sizes its cache from this and the router salts block keys with it, so both
    always agree on the layout.
    """
    kv_lora_rank = getattr(hf_config, "kv_lora_rank", None)
    if kv_lora_rank:
        return 1, 1, kv_lora_rank + hf_config.qk_rope_head_dim
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return 2, getattr(hf_config, "num_key_value_heads", None) or heads, head_dim


# Layer types that keep no per-token KV: linear attention and Mamba layers keep a per-request
# state instead (pdserve.engine.state_pool); MLP and MoE layers keep nothing.
STATE_LAYER_TYPES = ("linear_attention", "mamba")
NO_CACHE_LAYER_TYPES = ("mlp", "moe")
# Layers that keep both: Falcon-H1's "hybrid" layers run Mamba2 and attention side by side.
KV_AND_STATE_LAYER_TYPES = ("hybrid",)


def has_state_layers(hf_config) -> bool:
    """A hybrid model: its layer_types (Nemotron-H: layers_block_type) name layers that keep a
    recurrent state (linear attention, Mamba), instead of KV or (Falcon-H1) beside it."""
    types = getattr(hf_config, "layer_types", None) or getattr(hf_config, "layers_block_type", None) or ()
    return any(t in STATE_LAYER_TYPES + KV_AND_STATE_LAYER_TYPES for t in types)


def kv_layer_count(hf_config) -> int:
    """The layers that hold paged KV: every layer, but for a hybrid model (its layer_types name
    linear-attention, Mamba, MLP or MoE layers) only its attention layers (at least one, so the
    pool's blocks have a size)."""
    types = getattr(hf_config, "layer_types", None) or getattr(hf_config, "layers_block_type", None) or ()
    kv = [t for t in types if t not in STATE_LAYER_TYPES + NO_CACHE_LAYER_TYPES]
    if not types or len(kv) == len(types):
        return hf_config.num_hidden_layers
    return max(len(kv), 1)


def block_key(parent: bytes, token_ids: Sequence[int], salt: bytes, extra: bytes = b"") -> bytes:
    """extra: the keys of the images whose tokens the block holds (multimodal.block_extra); the
    placeholder token ids are the same for every image, so without it two prompts with the same
    text and different images would share KV. Empty for text, which keeps text keys unchanged."""
    packed = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return xxhash.xxh3_128_digest(parent + salt + packed + extra)


def state_key(block_key: bytes, state_layout: str) -> bytes:
    """The key of a hybrid model's recurrent state after the tokens whose chain ends in
    block_key (a full block's, or a prompt's trailing partial block's): in the blocks' own chain,
    so a state is found exactly where its prefix's KV is, and salted with the state's layout
    (pdserve.engine.state_pool.state_layout), so a node whose state bytes differ never reads it."""
    return xxhash.xxh3_128_digest(b"pdserve-state-v1|" + block_key + state_layout.encode())


def block_key_chain(token_ids: Sequence[int], block_size: int, salt: bytes,
                    include_partial: bool = False, images: Sequence[ImageInput] = ()) -> list[bytes]:
    """Keys of each full block of `token_ids`, chained from the root; optionally the trailing
    partial block too (its key covers only the tokens it holds, so it differs from any full block).
    images: the prompt's images, whose keys enter the blocks that hold their tokens."""
    keys: list[bytes] = []
    parent = ROOT_KEY
    n_full = len(token_ids) // block_size
    end = len(token_ids) if include_partial else n_full * block_size
    for start in range(0, end, block_size):
        stop = min(start + block_size, len(token_ids))
        extra = block_extra(images, start, stop) if images else b""
        parent = block_key(parent, token_ids[start:stop], salt, extra)
        keys.append(parent)
    return keys
