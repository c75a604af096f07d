"""Attention and KV-cache ops as Triton kernels: the GPU path (CPU under TRITON_INTERPRET=1).

Same three functions and contract as torch_ops. Cache views k_cache, v_cache are
[num_blocks, block_size, kv_heads, head_dim] and usually strided views into the block-major KV
tensor, so every kernel takes explicit strides. Slot = block_id * block_size + offset; -1 skips.

One attention kernel serves both decode and prefill. A program owns one (sequence, KV head,
query tile); the tile's rows are (query token, query head of that KV head's group) pairs, so a
decode step's whole GQA group shares each K/V load and fills the matrix-multiply rows that a
single query token would leave empty. Softmax is the online (flash) form, accumulated in fp32.
A sliding window (WINDOW keys up to the query's own) also bounds the key loops from below, and
attention sinks start each row's running state at (max = sink, sum = 1): a key with no value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # Optional fast prefill path; never required.
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_varlen_func = None

_MAX_HEAD_DIM = 256
# Decode launches depend on shapes only, never on values on the device (lengths are read inside
# the kernel), so a decode step through these ops may be captured in a CUDA graph.
CUDA_GRAPH_SAFE = True
# Launch options for decode with head_dim <= 64, e.g. {"BLOCK_N": 128, "num_warps": 8,
# "num_stages": 1}: that one was 1.18x faster alone (benchmarks/gpu/gpu_attention_tune.py, H100) but
# 13% slower inside the model's decode step, so None: the general launch.
DECODE_TUNING: dict | None = None
_LOG2E = 1.4426950408889634
_NO_WINDOW = 1 << 30  # "window" of a layer without one: every causal key is inside it
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# ----------------------------------------------------------------------------- store_kv

@triton.jit
def _store_kv_kernel(key, value, k_cache, v_cache, slots, kv_heads, head_dim, block_size,
                     s_kt, s_kh, s_kd, s_vt, s_vh, s_vd,
                     s_cb, s_co, s_ch, s_cd, s_wb, s_wo, s_wh, s_wd,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + tok).to(tl.int64)
    if slot < 0:  # -1: padding, or a token whose KV is not kept
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (h < kv_heads) & (d < head_dim)
    blk = slot // block_size  # int64: block * block-stride overflows int32 in big caches
    off = slot % block_size
    k = tl.load(key + tok * s_kt + h * s_kh + d * s_kd, mask=ok)
    v = tl.load(value + tok * s_vt + h * s_vh + d * s_vd, mask=ok)
    tl.store(k_cache + blk * s_cb + off * s_co + h * s_ch + d * s_cd,
             k.to(k_cache.dtype.element_ty), mask=ok)
    tl.store(v_cache + blk * s_wb + off * s_wo + h * s_wh + d * s_wd,
             v.to(v_cache.dtype.element_ty), mask=ok)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, kv_heads, head_dim] into the cache slots named by slot_mapping [T]."""
    tokens, kv_heads, head_dim = key.shape
    if tokens == 0:
        return
    _check_head_dim(head_dim)
    _store_kv_kernel[(tokens,)](
        key, value, k_cache, v_cache, slot_mapping, kv_heads, head_dim, k_cache.shape[1],
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))


# ----------------------------------------------------------------------------- attention

@triton.jit
def _online_softmax_step(q, k, v, keep, m_i, l_i, acc, qk_scale, DOT_DTYPE: tl.constexpr):
    """Fold one key tile into the running (max, sum, weighted-V) state; scores in log2 units."""
    # "ieee" keeps fp32 inputs out of TF32 (matches the torch path); other dtypes ignore it.
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee") * qk_scale
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no visible key yet keeps m = -inf; subtracting 0 instead avoids inf - inf = nan.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
        q, k_new, v_new, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables, sinks,
        qk_scale, head_dim, block_size, window,
        s_qt, s_qh, s_qd, s_nt, s_nh, s_nd, s_wt, s_wh, s_wd,
        s_kb, s_ko, s_kh, s_kd, s_vb, s_vo, s_vh, s_vd, s_ot, s_oh, s_od, s_bt, s_bc,
        GROUP: tl.constexpr, NEW_FROM_INPUT: tl.constexpr, DOT_DTYPE: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    seq, kv_head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
    ctx = tl.load(context_lens + seq)
    if tile * BLOCK_M >= q_len * GROUP:  # grid is sized for the longest sequence
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP  # query token within the sequence
    head = kv_head * GROUP + rows % GROUP  # query heads of a KV group are adjacent
    row_ok = tok < q_len
    q_pos = ctx - q_len + tok  # causal alignment: the new tokens END the context
    d = tl.arange(0, BLOCK_D)
    d_ok = d[None, :] < head_dim
    q_row = (q_start + tok).to(tl.int64)
    qt = tl.load(q + q_row[:, None] * s_qt + head[:, None] * s_qh + d[None, :] * s_qd,
                 mask=row_ok[:, None] & d_ok, other=0.0).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # the sink is a key of score `sink` and no value: start the state with it
        m_i = tl.load(sinks + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The tile's earliest query sees keys from first_key on (window is huge without a window).
    first_key = tl.maximum(ctx - q_len + (tile * BLOCK_M) // GROUP - window + 1, 0)

    # Part 1: keys in the paged cache, positions [0, n_cached); gathered per token so any
    # block_size works and a tile may span several (non-contiguous) blocks.
    n_cached = ctx
    if NEW_FROM_INPUT:
        n_cached = ctx - q_len
    # Keys past this tile's last query position are all masked: skip them.
    n_cached = tl.minimum(n_cached, ctx - q_len + (tile * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
    table = block_tables + seq.to(tl.int64) * s_bt
    for start in range((first_key // BLOCK_N) * BLOCK_N, n_cached, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        # Keys before first_key are never loaded: a sliding-window model may have freed their blocks.
        pos_ok = (pos < n_cached) & (pos >= first_key)
        blk = tl.load(table + (pos // block_size) * s_bc, mask=pos_ok, other=0).to(tl.int64)
        off = pos % block_size
        ld_ok = pos_ok[:, None] & d_ok
        k = tl.load(k_cache + blk[:, None] * s_kb + off[:, None] * s_ko + kv_head * s_kh
                    + d[None, :] * s_kd, mask=ld_ok, other=0.0)
        v = tl.load(v_cache + blk[:, None] * s_vb + off[:, None] * s_vo + kv_head * s_vh
                    + d[None, :] * s_vd, mask=ld_ok, other=0.0)
        keep = (pos_ok[None, :] & (pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
                & (pos[None, :] > q_pos[:, None] - window))
        m_i, l_i, acc = _online_softmax_step(qt, k, v, keep, m_i, l_i, acc, qk_scale, DOT_DTYPE)

    # Part 2 (prefill): the new tokens' own K/V straight from the inputs, causal among themselves.
    if NEW_FROM_INPUT:
        n_new = tl.minimum(q_len, (tile * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
        first_new = tl.maximum(first_key - (ctx - q_len), 0)
        for start in range((first_new // BLOCK_N) * BLOCK_N, n_new, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            j_ok = j < n_new
            kv_row = (q_start + j).to(tl.int64)
            ld_ok = j_ok[:, None] & d_ok
            k = tl.load(k_new + kv_row[:, None] * s_nt + kv_head * s_nh + d[None, :] * s_nd,
                        mask=ld_ok, other=0.0)
            v = tl.load(v_new + kv_row[:, None] * s_wt + kv_head * s_wh + d[None, :] * s_wd,
                        mask=ld_ok, other=0.0)
            keep = (j_ok[None, :] & (j[None, :] <= tok[:, None]) & row_ok[:, None]
                    & (j[None, :] > tok[:, None] - window))
            m_i, l_i, acc = _online_softmax_step(qt, k, v, keep, m_i, l_i, acc, qk_scale, DOT_DTYPE)

    # Rows with no visible key (only padding rows here) get 0 rather than 0/0.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out + q_row[:, None] * s_ot + head[:, None] * s_oh + d[None, :] * s_od,
             o.to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok)


def _dot_dtype(dtype: torch.dtype):
    """tl.dot operand type: the input's, except bf16 under TRITON_INTERPRET, whose dot multiplies
    raw bf16 bit patterns (triton-lang/triton#11584, unsupported upstream), so it gets fp32."""
    if dtype not in _TL_DTYPES:
        raise ValueError(f"triton kernels support float32/float16/bfloat16, got {dtype}")
    if dtype == torch.bfloat16 and triton.knobs.runtime.interpret:
        return tl.float32
    return _TL_DTYPES[dtype]


def _check_head_dim(head_dim: int) -> None:
    if head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"triton kernels support head_dim <= {_MAX_HEAD_DIM}, got {head_dim}")


def _launch(q, k_new, v_new, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
            scale, max_q_len, new_from_input, block_m, tuning: dict | None = None,
            window: int = 0, sinks: torch.Tensor | None = None):
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    _check_head_dim(head_dim)
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    group = heads // kv_heads
    out = torch.empty_like(q)
    num_seqs = context_lens.shape[0]
    if tokens == 0 or num_seqs == 0:
        return out
    # tl.dot needs every tile dimension >= 16.
    block_m = max(block_m, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 32 if block_d > 64 else 64  # keeps the K/V tiles within the register budget
    if max_q_len == 1 and block_d <= 64 and not tuning:
        tuning = DECODE_TUNING
    tuning = tuning or {}  # launch options a benchmark may try: BLOCK_N, num_warps, num_stages
    block_n = tuning.get("BLOCK_N", block_n)
    launch = {k: v for k, v in tuning.items() if k in ("num_warps", "num_stages")}
    grid = (num_seqs, kv_heads, triton.cdiv(max_q_len * group, block_m))
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    _paged_attention_kernel[grid](
        q, k_new, v_new, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables,
        q if sinks is None else sinks,  # q doubles as the unread pointer without sinks
        scale * _LOG2E, head_dim, k_cache.shape[1], window if window > 0 else _NO_WINDOW,
        *q.stride(), *k_new.stride(), *v_new.stride(), *k_cache.stride(), *v_cache.stride(),
        *out.stride(), *block_tables.stride(),
        GROUP=group, NEW_FROM_INPUT=new_from_input, DOT_DTYPE=_dot_dtype(q.dtype),
        HAS_SINKS=sinks is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, **launch)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, tuning: dict | None = None, window: int = 0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence: q [B, heads, head_dim] over each sequence's cached context.

    block_tables [B, max_blocks] int32; context_lens [B] int32, tokens in the cache including
    this one. Padding entries of block_tables are never read.
    """
    batch = q.shape[0]
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    # Everything, the current token included, is read from the cache; q doubles as the unused
    # k_new/v_new pointer.
    return _launch(q, q, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                   scale, max_q_len=1, new_from_input=False, block_m=16, tuning=tuning,
                   window=window, sinks=sinks)


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention for the new tokens of several sequences packed in q [T, heads, head_dim].

    The prefix (context minus the new tokens) is read from the paged cache; the new tokens' K/V
    come from k_new/v_new, which equals the cached copy when it is stored and stays right when a
    new token's slot is -1.
    """
    if not window and sinks is None:  # flash-attn's path is used for plain causal layers only
        fast = _flash_attn_prefill(q, k_new, v_new, k_cache, v_cache, cu_seqlens_q, context_lens,
                                   block_tables, scale)
        if fast is not None:
            return fast
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    max_q_len = int(q_lens.max()) if q_lens.numel() else 0
    return _launch(q, k_new, v_new, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                   scale, max_q_len=max_q_len, new_from_input=True, block_m=64,
                   window=window, sinks=sinks)


def _flash_attn_prefill(q, k_new, v_new, k_cache, v_cache, cu_seqlens_q, context_lens,
                        block_tables, scale):
    """flash-attn's varlen kernel when it is installed and the inputs suit it, else None.

    Untested here: the test machine has neither a GPU nor flash_attn. Its causal mask is
    bottom-right aligned (flash-attn >= 2.1), which matches this module's contract.
    """
    if flash_attn_varlen_func is None or not q.is_cuda or q.shape[0] == 0:
        return None
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] > 256:
        return None
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    max_q = int(q_lens.max())
    cu_q = cu_seqlens_q.to(torch.int32)
    if bool((context_lens == q_lens).all()):  # no prefix: attend over the new K/V directly
        return flash_attn_varlen_func(q, k_new, v_new, cu_q, cu_q, max_q, max_q,
                                      softmax_scale=scale, causal=True)
    # Paged K/V needs page sizes that are multiples of 256 and a unit-stride head dim.
    if k_cache.shape[1] % 256 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return None
    cu_k = torch.nn.functional.pad(context_lens.cumsum(0, dtype=torch.int32), (1, 0))
    return flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max_q,
                                  int(context_lens.max()), softmax_scale=scale, causal=True,
                                  block_table=block_tables.to(torch.int32))
