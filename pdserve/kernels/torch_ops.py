"""Attention and KV-cache ops in plain torch: the CPU path.

Cache views are per layer: k_cache, v_cache of shape [num_blocks, block_size, num_kv_heads,
head_dim]; they may be strided views into the block-major KV tensor. A slot is
block_id * block_size + offset; slot -1 means "do not store".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, kv_heads, head_dim] into the cache slots named by slot_mapping [T]."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    k_cache[blocks, offsets] = key
    v_cache[blocks, offsets] = value


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence's cache: [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    n_blocks = -(-length // block_size)
    return cache[block_table[:n_blocks].long()].flatten(0, 1)[:length]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query token per sequence: q [B, heads, head_dim] over each sequence's cached context.
    block_tables [B, max_blocks] int32, context_lens [B] int32 (tokens in the cache, incl. this one)."""
    batch, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max())
    n_blocks = -(-max_len // block_size)
    table = block_tables[:, :n_blocks].long()
    k = k_cache[table].reshape(batch, n_blocks * block_size, kv_heads, head_dim)[:, :max_len]
    v = v_cache[table].reshape(batch, n_blocks * block_size, kv_heads, head_dim)[:, :max_len]
    valid = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None].to(q.device)
    group = heads // kv_heads
    # Each KV head's query group attends as `group` query rows: one batched SDPA, no repeat.
    qg = q.reshape(batch, kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(batch, heads, head_dim)


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal attention for the new tokens of several sequences packed in q [T, heads, head_dim].

    Sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1]; those are the last tokens of its
    context_lens[i]-token context, whose K/V (prefix and new) are already in the cache. k_new and
    v_new [T, kv_heads, head_dim] are the new tokens' K/V, used directly when there is no prefix.
    """
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    ctx_lens = context_lens.tolist()
    for i, ctx in enumerate(ctx_lens):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        if ctx == q_len:
            k, v, mask = k_new[start:end], v_new[start:end], None
        else:
            k = gather_kv(k_cache, block_tables[i], ctx)
            v = gather_kv(v_cache, block_tables[i], ctx)
            q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        out[start:end] = _sdpa_causal(q[start:end], k, v, mask, scale)
    return out


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=mask is None,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
