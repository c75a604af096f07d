"""Multi-head latent attention (MLA) over a paged latent cache, in plain torch.

An MLA layer caches one latent vector per token: [kv_lora_rank compressed K/V | qk_rope_head_dim
rotated key], shared by every head. The per-layer cache view is [num_blocks, block_size, 1,
latent_dim] (a strided view into the block-major cache, like the K/V kernels' views), and a
slot is block_id * block_size + offset; slot -1 means "do not store".

Decode uses the absorbed form: each head's query is already projected into the latent space
(q_nope @ W_UK, then the rotated part), so attention is one shared "KV head" whose keys are the
whole latent and whose values are its first kv_lora_rank entries. The caller projects the
result out through W_UV. Prefill expands the latent into K/V per head (see pdserve.models.mla)
and attends with prefill_attention here.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write latent [T, latent_dim] into the cache slots named by slot_mapping [T]."""
    block_size = cache.shape[1]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        latent, slot_mapping = latent[keep], slot_mapping[keep]
    cache[slot_mapping // block_size, slot_mapping % block_size, 0] = latent


def gather_latent(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence's latent cache: [length, latent_dim]."""
    block_size = cache.shape[1]
    n_blocks = -(-length // block_size)
    return cache[block_table[:n_blocks].long(), :, 0].flatten(0, 1)[:length]


def paged_latent_decode(q: torch.Tensor, cache: torch.Tensor, value_dim: int, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One absorbed query per sequence: q [B, heads, latent_dim] over each sequence's cached
    latents; the values are each latent's first value_dim entries. Returns [B, heads, value_dim].
    block_tables [B, max_blocks] int32, context_lens [B] int32 (tokens in the cache, incl. this one)."""
    batch, heads, latent_dim = q.shape
    block_size = cache.shape[1]
    max_len = int(context_lens.max())
    n_blocks = -(-max_len // block_size)
    table = block_tables[:, :n_blocks].long()
    keys = cache[table, :, 0].reshape(batch, n_blocks * block_size, latent_dim)[:, :max_len]
    valid = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None].to(q.device)
    # All heads share the one latent "KV head": heads become query rows of one SDPA per sequence.
    out = F.scaled_dot_product_attention(q[:, None], keys[:, None], keys[:, None, :, :value_dim],
                                         attn_mask=valid[:, None, None, :], scale=scale)
    return out[:, 0]


def latent_decode_for(ops) -> Callable[..., torch.Tensor]:
    """The absorbed decode op that goes with an attention backend module: the Triton kernel
    (pdserve.kernels.mla_triton) beside the Triton ops, else this module's torch version."""
    if getattr(ops, "__name__", "") != "pdserve.kernels.triton_ops":
        return paged_latent_decode
    triton_decode = importlib.import_module("pdserve.kernels.mla_triton").paged_latent_decode

    def decode(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # float32 on a GPU: the kernel's exact (non-TF32) fp32 dots ran slower than this torch
        # op on an H100, so it is the kernel for 16-bit caches (and for CPU tests).
        if q.dtype == torch.float32 and q.is_cuda:
            return paged_latent_decode(q, *args, **kwargs)
        return triton_decode(q, *args, **kwargs)
    return decode


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: list[int],
                      cu_seqlens_k: list[int], scale: float) -> torch.Tensor:
    """Causal attention of expanded queries over expanded keys/values, several sequences packed.

    Sequence i's queries are q[cu_seqlens_q[i]:cu_seqlens_q[i+1]] ([n, heads, qk_dim]), the last
    n tokens of its context, whose keys and values are k/v[cu_seqlens_k[i]:cu_seqlens_k[i+1]]
    ([ctx, heads, qk_dim] and [ctx, heads, v_dim]). Returns [T, heads, v_dim]."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe, ks, ke = cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i], cu_seqlens_k[i + 1]
        q_len, ctx = qe - qs, ke - ks
        mask = None
        if ctx != q_len:  # a cached prefix before the new tokens: causal with an offset
            q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        qt, kt, vt = (t.transpose(0, 1)[None] for t in (q[qs:qe], k[ks:ke], v[ks:ke]))
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=mask is None, scale=scale)
        out[qs:qe] = o[0].transpose(0, 1)
    return out
