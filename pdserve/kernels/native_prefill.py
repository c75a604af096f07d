"""Prefill attention on CPU: fresh prompts in one compiled call (native_prefill.c), the rest in torch.

A prefill step's sequences that have no cached prefix (every key is a new token), no sliding
window shorter than the prompt, no attention sinks and no per-query key ends (image tokens) are
plain causal attention over their own K and V: native_prefill.c runs all of them in one parallel
region, each KV head's query group reading its keys once. torch's CPU flash attention, called
per sequence, took a fifth of a bf16 prefill of SmolLM2 there. A chunk after a cached prefix (a
prefix hit, a long prompt's second chunk) runs in a second call, its prefix gathered from the
cache before its new keys. Windows, sinks and images go through torch_ops, as does everything
where the compiled library is missing (no compiler, neither AVX-512 nor AVX2).

Where the step's products are bf16 tiles already (dequant_tiles.tile_dtype(), never under float32
products), the same attention runs with its two products in bf16: on AMX's tiles where the CPU has
them (native_prefill_amx.c), else in AVX-512 BF16's vdpbf16ps (native_prefill_dpbf16.c, Zen 4
and 5): queries and probabilities rounded to bf16, as vLLM's CPU attention does. Over a bf16 KV
cache (fp8_kv.NarrowKVOps) prefill_attention_bf16_cache gives that kernel the prompts with a
cached prefix too, read from the cache's blocks. On the 2-core AMX Xeon, a layer of 13 SmolLM2
prompts of 160 tokens: 2.7 -> 1.55 ms; 128 such prompts through 10 prefill steps 4.90 s (float32
kernel), 4.61 s (AMX, fresh prompts), 4.26 s (AMX, cached prefixes too).
"""
from __future__ import annotations

import torch

from pdserve.kernels import dequant_tiles, native_gemv, torch_ops
from pdserve.kernels.torch_ops import PREFILL_KEY_ENDS  # noqa: F401  (same contract as torch_ops)

HEAD_DIM_STEP = 64  # the kernel's output tile: head_dim must be a multiple
bf16_calls = 0  # calls a bf16 kernel (AMX's or vdpbf16ps') took (tests check which kernel ran)


def _kernels() -> list:
    """The kernels to try in order (typed in native_gemv.library(), the library as it is now, see
    native_paged): a bf16 one under bf16 tile products, then float32's; none without the library."""
    lib = native_gemv.library()
    if lib is None:
        return []
    backend = bf16_backend()
    if backend:
        return [getattr(lib, f"pd_prefill_attention_{backend}"), lib.pd_prefill_attention]
    return [lib.pd_prefill_attention]


def bf16_backends() -> list[str]:
    """The bf16 kernels this CPU runs, the first preferred: "amx" (its tiles), "dpbf16" (AVX-512 BF16)."""
    return ["amx"] * dequant_tiles.native_amx() + ["dpbf16"] * dequant_tiles.avx512_bf16()


def bf16_backend() -> str | None:
    """The bf16 kernel to run: the step's products are bf16 tiles and the CPU has one (else None)."""
    backends = bf16_backends()
    return backends[0] if backends and dequant_tiles.tile_dtype() == torch.bfloat16 else None


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, window: int = 0, sinks: torch.Tensor | None = None,
                      key_ends: torch.Tensor | None = None) -> torch.Tensor:
    """torch_ops.prefill_attention's contract; fresh prompts through the compiled kernel."""
    kernels = _kernels() if _compiled_shape(q, k_new, v_new, sinks, key_ends) else []
    if not kernels:
        return torch_ops.prefill_attention(q, k_new, v_new, k_cache, v_cache, cu_seqlens_q, context_lens,
                                           block_tables, scale, window, sinks, key_ends)
    cu, contexts = cu_seqlens_q.tolist(), context_lens.tolist()
    fresh = [i for i, ctx in enumerate(contexts)
             if ctx == cu[i + 1] - cu[i] > 0 and (not window or window >= ctx)]
    out = torch.empty(q.shape, dtype=q.dtype)
    if fresh:
        starts = torch.tensor([cu[i] for i in fresh], dtype=torch.int32)
        lens = torch.tensor([contexts[i] for i in fresh], dtype=torch.int32)
        if not _run_fresh(kernels, q, k_new, v_new, starts, lens, scale, out):
            fresh = []
    done = set(fresh)
    prefixed = [i for i, ctx in enumerate(contexts)
                if ctx > cu[i + 1] - cu[i] > 0 and (not window or window >= ctx)]
    if prefixed and _run_prefixed(q, k_new, v_new, k_cache, v_cache, cu, contexts, block_tables, prefixed, scale, out):
        done.update(prefixed)
    if len(done) < len(contexts):
        torch_ops.attend_each(q, k_new, v_new, k_cache, v_cache, cu, contexts, block_tables, scale, window,
                              sinks, key_ends, out, skip=done)
    return out


def _run_prefixed(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, cu: list[int], contexts: list[int], block_tables: torch.Tensor,
                  seqs: list[int], scale: float, out: torch.Tensor) -> bool:
    """Chunks after a cached prefix (float32 caches: a bf16 one's blocks come widened, see
    fp8_kv.NarrowKVOps) through the compiled kernel, each sequence's prefix gathered before its new
    keys. torch's path (attend_each) ran two attentions a sequence and merged them: a 2,400-token
    prompt in 1,024-token chunks prefilled in 1.81 s against 1.25 s as one fresh chunk (Zen 5)."""
    if not (k_cache.dtype == v_cache.dtype == torch.float32 and k_cache.device.type == "cpu"):
        return False
    lens = [cu[i + 1] - cu[i] for i in seqs]
    prefixes = [contexts[i] - n for i, n in zip(seqs, lens)]
    ks, vs, kv_starts = [], [], [0]
    for i, prefix in zip(seqs, prefixes):
        ks += [torch_ops.gather_kv(k_cache, block_tables[i], prefix), k_new[cu[i]:cu[i + 1]]]
        vs += [torch_ops.gather_kv(v_cache, block_tables[i], prefix), v_new[cu[i]:cu[i + 1]]]
        kv_starts.append(kv_starts[-1] + contexts[i])  # each sequence's rows of k and v, prefix first
    k, v = torch.cat(ks), torch.cat(vs)
    starts, lens, prefixes = _int32([cu[i] for i in seqs]), _int32(lens), _int32(prefixes)
    kv_rows = _int32(kv_starts[:-1])
    rc = native_gemv.library().pd_prefill_attention_prefixed(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), starts.data_ptr(),
        kv_rows.data_ptr(), prefixes.data_ptr(), lens.data_ptr(), len(seqs), q.shape[1], k.shape[1], q.shape[2],
        scale, out.data_ptr(), torch.get_num_threads())
    return rc == 0


def _int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def prefill_attention_bf16_cache(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                                 v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                                 block_tables: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Every sequence of a prefill step, fresh or after a cached prefix in a bf16 paged cache
    [blocks, block_size, kv_heads, head_dim] (fp8_kv.NarrowKVOps's), in one call of a bf16
    kernel, the prefix read from the cache's blocks as they are (torch's path gathered and widened
    them, then attended each such sequence apart: a twentieth of a prefill of 128 prompts whose
    chunks straddle steps); None where no such kernel applies (float32 products, neither AMX nor
    AVX-512 BF16, a layout it does not take): no window, sinks or key ends here."""
    global bf16_calls
    lib, backend = native_gemv.library(), bf16_backend()
    if (lib is None or backend is None or not _compiled_shape(q, k_new, v_new, None, None)
            or not bf16_blocks_dense(k_cache, v_cache, k_new.shape[1], k_new.shape[2])):
        return None
    new = cu_seqlens_q.diff().to(torch.int32)
    prefix = context_lens.to(torch.int32) - new
    if bool((prefix < 0).any()):
        return None
    starts = cu_seqlens_q[:-1].to(torch.int32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    rc = getattr(lib, f"pd_prefill_attention_{backend}_paged")(
        q.data_ptr(), q.stride(0), k_new.data_ptr(), k_new.stride(0), v_new.data_ptr(), v_new.stride(0),
        starts.data_ptr(), new.data_ptr(), prefix.data_ptr(), len(new), q.shape[1], k_new.shape[1], q.shape[2], scale,
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1], k_cache.stride(0), tables.data_ptr(), tables.shape[1],
        out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        return None
    bf16_calls += 1
    return out


def bf16_blocks_dense(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_heads: int, head_dim: int) -> bool:
    """bf16 caches on CPU of [blocks, block_size, kv_heads, head_dim], each block's slots dense and
    K's and V's blocks the same stride apart: the layout the compiled bf16 kernels address by
    block index alone (this one, and fp8_kv.store_bf16_rows's store)."""
    dense = (kv_heads * head_dim, head_dim, 1)
    return all(c.dtype == torch.bfloat16 and c.device.type == "cpu" and c.dim() == 4
               and tuple(c.shape[2:]) == (kv_heads, head_dim) and c.stride()[1:] == dense
               and c.stride(0) == k_cache.stride(0) for c in (k_cache, v_cache))


def _run_fresh(kernels: list, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
               lens: torch.Tensor, scale: float, out: torch.Tensor) -> bool:
    """The fresh sequences' attention into out by the first kernel that takes them."""
    global bf16_calls
    for kernel in kernels:
        rc = kernel(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), starts.data_ptr(),
                    lens.data_ptr(), len(starts), q.shape[1], k.shape[1], q.shape[2], scale, out.data_ptr(),
                    torch.get_num_threads())
        if rc == 0:
            bf16_calls += len(kernels) > 1 and kernel is kernels[0]
            return True
    return False


def _compiled_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                    key_ends: torch.Tensor | None) -> bool:
    """Whether the kernel takes these tensors: float32 on CPU, each token's [heads, head_dim]
    contiguous (tokens may be strided: views of the step's qkv), head_dim a multiple of 64."""
    return (sinks is None and key_ends is None and q.device.type == "cpu"
            and q.dtype == k.dtype == v.dtype == torch.float32 and q.shape[2] % HEAD_DIM_STEP == 0
            and q.shape[1] % k.shape[1] == 0 and all(_rows_dense(t) for t in (q, k, v)))


def _rows_dense(t: torch.Tensor) -> bool:
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]
