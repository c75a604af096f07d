"""Attention and KV-cache ops in plain torch: the CPU path.

Cache views are per layer: k_cache, v_cache of shape [num_blocks, block_size, num_kv_heads,
head_dim]; they may be strided views into the block-major KV tensor. A slot is
block_id * block_size + offset; slot -1 means "do not store".

Both attention ops take two optional per-layer arguments:
- window W > 0 (sliding-window layers): the query at position i sees keys i-W+1..i only;
- sinks [heads] (learned attention sinks): one extra logit per head that joins the softmax's
  denominator and carries no value.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# The CPU flash-attention kernel behind SDPA, called directly for the log-sum-exp it returns
# beside the output (prefill merges a prefix part and a causal part with it).
# prefill_attention takes key_ends (a query may see keys past its own position): what a model
# with bidirectional image tokens needs (other backends' kernels are causal only).
PREFILL_KEY_ENDS = True
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


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


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, first: int = 0) -> torch.Tensor:
    """Tokens [first, length) of one sequence's cache: [length - first, kv_heads, head_dim].
    Blocks wholly before `first` are never read (a sliding-window model may have freed them).
    index_select, not cache[ids]: advanced indexing's generic kernel took 3.5 times as long to
    copy 128 blocks out of a strided layer view (one thread)."""
    block_size = cache.shape[1]
    first_block, n_blocks = first // block_size, -(-length // block_size)
    tokens = cache.index_select(0, block_table[first_block:n_blocks].long()).flatten(0, 1)
    return tokens[first - first_block * block_size:length - first_block * block_size]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence: q [B, heads, head_dim] over each sequence's cached context.
    block_tables [B, max_blocks] int32, context_lens [B] int32 (tokens in the cache, incl. this one)."""
    batch, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    table, pos = _decode_blocks(block_tables, context_lens, block_size, window)
    n_keys = table.shape[1] * block_size
    k = k_cache[table].reshape(batch, n_keys, kv_heads, head_dim)
    v = v_cache[table].reshape(batch, n_keys, kv_heads, head_dim)
    lens, pos = context_lens[:, None].to(q.device), pos.to(q.device)
    valid = pos < lens
    if window:
        valid &= pos >= lens - window
    group = heads // kv_heads
    # Each KV head's query group attends as `group` query rows: one batched SDPA, no repeat.
    qg = q.reshape(batch, kv_heads, group, head_dim)
    if sinks is not None:
        out = _attend_with_sinks(qg, k.transpose(1, 2), v.transpose(1, 2), valid[:, None, None, :],
                                 scale, sinks.view(1, kv_heads, group))
    else:
        out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(batch, heads, head_dim)


def _decode_blocks(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                   window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks each sequence's decode reads, [B, n] block ids, and the position of every
    key in them, [B, n * block_size]. With a window, row b starts at the block holding key
    len_b - window: earlier blocks are never read (a sliding-window model has freed them).
    A row's slots past its own blocks read block 0, and are masked by position."""
    lens = context_lens.long()
    n_blocks = -(-int(lens.max()) // block_size)
    start = (lens - window).clamp_min(0) // block_size if window else torch.zeros_like(lens)
    if window:  # W consecutive keys span at most this many blocks
        n_blocks = min(n_blocks, (window + block_size - 2) // block_size + 1)
    index = start[:, None] + torch.arange(n_blocks, device=lens.device)[None, :]
    owned = index * block_size < lens[:, None]
    table = block_tables.long().gather(1, index.clamp_max(block_tables.shape[1] - 1))
    table = torch.where(owned, table, 0)
    pos = (index[:, :, None] * block_size + torch.arange(block_size, device=lens.device)).flatten(1)
    return table, pos


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, window: int = 0, sinks: torch.Tensor | None = None,
                      key_ends: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention for the new tokens of several sequences packed in q [T, heads, head_dim].

    Sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1]; those are the last tokens of its
    context_lens[i]-token context, whose K/V (prefix and new) are already in the cache. k_new and
    v_new [T, kv_heads, head_dim] are the new tokens' K/V, used directly when there is no prefix.
    key_ends [T] (optional): each query sees the keys at positions below its entry instead of up
    to its own (a Gemma 3 image token sees its whole image); a window still counts back from
    the query's own position.
    """
    out = torch.empty_like(q)
    attend_each(q, k_new, v_new, k_cache, v_cache, cu_seqlens_q.tolist(), context_lens.tolist(), block_tables,
                scale, window, sinks, key_ends, out)
    return out


def attend_each(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, cu: list[int], contexts: list[int], block_tables: torch.Tensor,
                scale: float, window: int, sinks: torch.Tensor | None, key_ends: torch.Tensor | None,
                out: torch.Tensor, skip: set[int] = frozenset()) -> None:
    """prefill_attention's rows of each sequence but those in skip (computed elsewhere), into out."""
    for i, ctx in enumerate(contexts):
        rows = slice(cu[i], cu[i + 1])
        q_len = rows.stop - rows.start
        if q_len == 0 or i in skip:
            continue
        ends = _reaching_ends(key_ends, rows, ctx)
        if (window and window < ctx) or ends is not None:  # some query's keys are not a causal prefix
            out[rows] = _masked_prefill(q[rows], k_new[rows], v_new[rows], k_cache, v_cache,
                                        block_tables[i], ctx, scale, window, sinks, ends)
        elif ctx == q_len and sinks is None:
            out[rows] = _sdpa_causal(q[rows], k_new[rows], v_new[rows], None, scale)
        elif q.device.type == "cpu" and _FLASH_CPU is not None:
            out[rows] = _prefix_then_causal(q[rows], k_new[rows], v_new[rows], k_cache, v_cache,
                                            block_tables[i], ctx - q_len, scale, sinks)
        else:
            out[rows] = _masked_prefill(q[rows], k_new[rows], v_new[rows], k_cache, v_cache,
                                        block_tables[i], ctx, scale, 0, sinks)


def _reaching_ends(key_ends: torch.Tensor | None, rows: slice, ctx: int) -> torch.Tensor | None:
    """One sequence's key ends, or None where every query's is its own position + 1 (causal)."""
    if key_ends is None:
        return None
    ends = key_ends[rows]
    causal = torch.arange(ctx - ends.shape[0] + 1, ctx + 1, device=ends.device)
    return ends if bool((ends != causal).any()) else None


def _masked_prefill(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_table: torch.Tensor, ctx: int, scale: float,
                    window: int, sinks: torch.Tensor | None, key_ends: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """One sequence's new tokens q [L, H, D] over all its visible keys with an explicit mask:
    sliding windows, and devices without the CPU flash kernel."""
    q_len = q.shape[0]
    if ctx == q_len:
        k, v = k_new, v_new
    else:
        first = max(0, ctx - q_len - window + 1) if window else 0  # keys before it are out of every window
        k = gather_kv(k_cache, block_table, ctx, first)
        v = gather_kv(v_cache, block_table, ctx, first)
    q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
    k_pos = torch.arange(ctx - k.shape[0], ctx, device=q.device)[None, :]
    mask = (k_pos < key_ends[:, None]) if key_ends is not None else (k_pos <= q_pos)
    mask = mask & ((k_pos > q_pos - window) if window else True)
    if sinks is not None:
        return _prefill_with_sinks(q, k, v, mask, scale, sinks)
    return _sdpa_causal(q, k, v, mask, scale)


def _prefix_then_causal(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, block_table: torch.Tensor, prefix: int, scale: float,
                        sinks: torch.Tensor | None) -> torch.Tensor:
    """One sequence's new tokens q [L, H, D] after `prefix` cached tokens, with no window.

    Every new token sees the whole prefix, so that part needs no mask; the new tokens among
    themselves are plain causal. The two softmaxes (and the sink's logit) merge exactly through
    their log-sum-exps. A bool-masked SDPA over all prefix + L keys costs more than both: the
    CPU kernel reads and applies the mask for every score (measured: 3.6 against 3.2 ms for one
    layer of 64 queries over 2112 keys, one thread)."""
    out, lse = _causal_with_lse(q, k_new, v_new, scale)
    parts = [(out, lse)]
    if prefix:
        k = gather_kv(k_cache, block_table, prefix)
        v = gather_kv(v_cache, block_table, prefix)
        parts.append(_unmasked_with_lse(q, k, v, scale))
    # Written out, not logsumexp over a stack: its generic kernel cost ~0.1 ms a call here.
    peak = lse if prefix == 0 else torch.maximum(lse, parts[1][1])
    if sinks is not None:
        sink = sinks.float()
        peak = torch.maximum(peak, sink)
        denom = torch.exp(sink - peak)
    else:
        denom = torch.zeros_like(peak)
    total = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for o, part_lse in parts:
        weight = torch.exp(part_lse - peak)
        denom += weight
        total += weight[..., None] * o.float()
    return (total / denom[..., None]).to(q.dtype)


def _causal_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of L queries over their own L keys: output [L, H, D] and the log-sum-exp
    of each row's scaled scores [L, H] (float32). The flash kernel has no GQA: the L new keys
    are few, so repeat them per query head."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out, lse = _FLASH_CPU(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                          is_causal=True, scale=scale)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1).float()


def _unmasked_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query over all keys k, v [C, KVH, D], no mask: output [L, H, D] and log-sum-exp
    [L, H]. A KV head's query group becomes group * L rows of one head (rows are independent
    without a mask), so the C keys are never repeated."""
    q_len, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    qg = q.reshape(q_len, kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * q_len, head_dim)
    out, lse = _FLASH_CPU(qg, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale)
    out = out.view(kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(q_len, heads, head_dim)
    return out, lse.view(kv_heads, group, q_len).permute(2, 0, 1).reshape(q_len, heads).float()


def _prefill_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """One sequence: q [L, H, D], k/v [C, KVH, D], mask [L, C] -> [L, H, D]."""
    q_len, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    qg = q.permute(1, 0, 2).reshape(kv_heads, group * q_len, head_dim)  # rows: (head, token)
    row_sinks = sinks.view(kv_heads, group).repeat_interleave(q_len, dim=1)
    out = _attend_with_sinks(qg, k.transpose(0, 1), v.transpose(0, 1), mask.repeat(group, 1),
                             scale, row_sinks)
    return out.view(heads, q_len, head_dim).transpose(0, 1)


def _attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax attention whose denominator also holds exp(sink) per query row, in float32.
    q [..., R, D], k/v [..., C, D], mask broadcast to [..., R, C], sinks broadcast to [..., R]."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().expand(scores.shape[:-1])
    peak = torch.maximum(scores.amax(dim=-1), sink)
    probs = torch.exp(scores - peak[..., None])
    denom = probs.sum(dim=-1) + torch.exp(sink - peak)
    return ((probs @ v.float()) / denom[..., None]).to(q.dtype)


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=mask is None,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
