"""A KV cache narrower than the model's float32 over any kernel module: `--kv-cache-dtype fp8`
(e4m3, with per-layer scales) or `--kv-cache-dtype bfloat16` (rounded to nearest even, no scales).

The cache holds float8_e4m3fn values x / scale, with one K scale and one V scale per layer.
The scales come from the checkpoint (`...self_attn.k_scale` / `v_scale`, as llm-compressor
writes them) and are 1.0 where it has none, as vLLM does by default. Every node derives them
from the same files, never from the data it happens to see, so a block quantized on a prefill
node means the same on a decode node, and its bytes can be handed over as they are.

A bf16 cache takes the same path in the Python layers (its scales are all 1.0); the compiled
decode step reads it directly (native_decode.c). The attention ops dequantize as they load: each call gathers the blocks its block tables name
(decode: the batch's blocks; prefill: the prefix blocks), widens them to the query's dtype in a
small compact cache, renumbers the tables into it, and runs the wrapped module's own kernel
(torch or numba) on that. The new tokens' K/V in a prefill pass through the same rounding, so
a prompt's result does not depend on whether its prefix came from the cache or was computed.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.kernels import native_gemv, native_paged, native_prefill, torch_ops

log = logging.getLogger(__name__)
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: casts beyond it give NaN, so values saturate first
_SCALE_NAME = re.compile(r"layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$")


KV_CACHE_DTYPES = {"fp8": FP8, "bfloat16": torch.bfloat16}  # --kv-cache-dtype's narrow choices


def kv_cache_torch_dtype(kv_cache_dtype: str, auto_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type: "auto" is auto_dtype (the model's, or bf16 under a CPU's
    low-precision products: pdserve.assembly.build.auto_kv_dtype), "fp8" float8_e4m3fn,
    "bfloat16" bfloat16."""
    if kv_cache_dtype == "auto":
        return auto_dtype
    if kv_cache_dtype in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[kv_cache_dtype]
    raise ValueError(f"kv_cache_dtype must be auto, fp8 or bfloat16, got {kv_cache_dtype!r}")


def is_kv_scale(name: str) -> bool:
    """A checkpoint's per-layer KV-cache scale: read here, not a model weight."""
    return _SCALE_NAME.search(name) is not None


def quantize(x: torch.Tensor, scale: float, cache_dtype: torch.dtype = FP8) -> torch.Tensor:
    if cache_dtype != FP8:
        return x.to(cache_dtype)  # bf16: no scale (every scale is 1.0)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    # a bf16 cache's scales are all 1.0: multiplying by one was a third of a bf16-cache prefill's
    # elementwise time
    return x.to(dtype) if scale == 1.0 else x.to(dtype) * scale


def checkpoint_kv_scales(model_path: Path, num_layers: int) -> list[tuple[float, float]]:
    """Per layer (k_scale, v_scale) from a safetensors checkpoint; 1.0 where it has none."""
    scales = [[1.0, 1.0] for _ in range(num_layers)]
    files = sorted(model_path.glob("*.safetensors")) if model_path.is_dir() else []
    if not files:
        return [tuple(s) for s in scales]
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                m = _SCALE_NAME.search(name)
                if m and int(m.group(1)) < num_layers:
                    plane = 0 if (m.group(2) or m.group(3)) == "k" else 1
                    scales[int(m.group(1))][plane] = float(f.get_tensor(name).float().max())
    found = sum(s != [1.0, 1.0] for s in scales)
    log.info("FP8 KV cache: checkpoint scales for %d of %d layers (the rest 1.0)", found, num_layers)
    return [tuple(s) for s in scales]


def _compact_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    scales: tuple[float, float], dtype: torch.dtype):
    """The blocks block_tables names, dequantized into a compact cache, and the tables renumbered
    into it. Padding entries (negative) read compact block 0; the kernels mask them by length."""
    tables = block_tables.long().clamp_min(0)
    ids = torch.unique(tables.flatten())
    if ids.numel() == 0:
        ids = torch.zeros(1, dtype=torch.long, device=tables.device)
    local = torch.searchsorted(ids, tables).to(block_tables.dtype)
    k = dequantize(k_cache.index_select(0, ids), scales[0], dtype)
    v = dequantize(v_cache.index_select(0, ids), scales[1], dtype)
    return k, v, local


def _narrowed(extra: dict) -> bool:
    """Whether a window, sinks or key ends narrow which keys a query sees."""
    return bool(extra.get("window") or extra.get("sinks") is not None or extra.get("key_ends") is not None)


def _reads_cache(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, extra: dict) -> bool:
    """Whether a prefill's attention reads the cache: some sequence has a cached prefix, or a
    window, sinks or key ends route it through a path that gathers from the cache."""
    if _narrowed(extra):
        return True
    return bool((context_lens.to(cu_seqlens_q.dtype) != cu_seqlens_q.diff()).any())


class NarrowKVOps:
    """A kernel module's store_kv / paged_decode_attention / prefill_attention over an FP8 or bf16 cache.
    The ops are called with one layer's cache views; the layer (and so its scales) is found by
    the K view's address, which is distinct for every layer of the block-major cache."""

    def __init__(self, base, kv_cache: torch.Tensor, scales: list[tuple[float, float]],
                 k_views: list[torch.Tensor] | None = None):
        self.base, self.scales, self.cache_dtype = base, scales, kv_cache.dtype
        self.__name__ = base.__name__  # the fused norm/RoPE kernels that go with it do not touch KV
        # k_views: each layer's K view as the ops get it (a TP rank's starts at its first head).
        k_views = k_views or [kv_cache[:, i, 0] for i in range(kv_cache.shape[1])]
        self._layer_of = {k.data_ptr(): i for i, k in enumerate(k_views)}
        # the last store_kv's rows and their values as a bf16 cache holds them (store_bf16_rows),
        # for the prefill_attention that follows it in the same layer
        self._seen: tuple[torch.Tensor, ...] | None = None

    def _scales(self, k_cache: torch.Tensor) -> tuple[float, float]:
        return self.scales[self._layer_of[k_cache.data_ptr()]]

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        ks, vs = self._scales(k_cache)
        self._seen = None
        if self.cache_dtype == torch.bfloat16 and (ks, vs) == (1.0, 1.0):
            seen = store_bf16_rows(key, value, k_cache, v_cache, slot_mapping)
            if seen is not None:
                self._seen = (key, value, *seen)
                return
        # numba's compiled store takes a bf16 cache on CPU (torch's index_put took 1.3 ms a layer
        # for a 2,048-token prefill); FP8, and any cache elsewhere, keep torch's
        store = (self.base.store_kv if self.cache_dtype == torch.bfloat16 and k_cache.device.type == "cpu"
                 else torch_ops.store_kv)
        store(quantize(key, ks, self.cache_dtype), quantize(value, vs, self.cache_dtype), k_cache, v_cache,
              slot_mapping)

    def paged_decode_attention(self, q, k_cache, v_cache, block_tables, context_lens, scale, **extra):
        if self.cache_dtype == torch.bfloat16 and self._scales(k_cache) == (1.0, 1.0):
            # the compiled kernel reads the bf16 blocks as they are (CPU; None elsewhere)
            out = native_paged.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                      **extra)
            if out is not None:
                return out
        k, v, tables = _compact_blocks(k_cache, v_cache, block_tables, self._scales(k_cache), q.dtype)
        return self.base.paged_decode_attention(q, k, v, tables, context_lens, scale, **extra)

    def prefill_attention(self, q, k_new, v_new, k_cache, v_cache, cu_seqlens_q, context_lens,
                          block_tables, scale, **extra):
        ks, vs = self._scales(k_cache)
        k_new, v_new = self._as_cached(k_new, v_new, (ks, vs), q.dtype)
        if self.cache_dtype == torch.bfloat16 and (ks, vs) == (1.0, 1.0) and not _narrowed(extra):
            # AMX's kernel reads a cached prefix from the bf16 blocks as they are (CPU; None elsewhere)
            out = native_prefill.prefill_attention_bf16_cache(q, k_new, v_new, k_cache, v_cache, cu_seqlens_q,
                                                              context_lens, block_tables, scale)
            if out is not None:
                return out
        if _reads_cache(cu_seqlens_q, context_lens, extra):
            k, v, tables = _compact_blocks(k_cache, v_cache, block_tables, (ks, vs), q.dtype)
        else:  # no prefix and no window: the base kernel takes every key from k_new / v_new
            k, v, tables = k_cache, v_cache, block_tables
        return self.base.prefill_attention(q, k_new, v_new, k, v, cu_seqlens_q, context_lens, tables,
                                           scale, **extra)

    def _as_cached(self, k_new: torch.Tensor, v_new: torch.Tensor, scales: tuple[float, float],
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The new keys and values as the cache holds them: the values store_kv rounded where these
        are its rows' tail (a step's prefill rows follow its decode rows), else rounded here."""
        seen, self._seen = self._seen, None
        if seen is not None and dtype == torch.float32:
            key, value, k_seen, v_seen = seen
            d = key.shape[0] - k_new.shape[0]
            if all(0 <= d and new.shape == whole[d:].shape and new.stride() == whole.stride()
                   and new.data_ptr() == whole[d:].data_ptr() for new, whole in ((k_new, key), (v_new, value))):
                return k_seen[d:], v_seen[d:]
        return tuple(dequantize(quantize(x, scale, self.cache_dtype), scale, dtype)
                     for x, scale in zip((k_new, v_new), scales))


def narrow_kv_ops(ops, kv_cache: torch.Tensor, model_dtype: torch.dtype, model_path: Path, num_layers: int,
                  k_views: list[torch.Tensor] | None = None):
    """ops over a cache narrower than the model (the driver's and each TP/PP worker's): FP8 with
    the checkpoint's scales, another dtype than the model's (bf16 under a float32 model) with
    scales 1.0; ops itself for a cache in the model's dtype."""
    if kv_cache.dtype == FP8:
        return NarrowKVOps(ops, kv_cache, checkpoint_kv_scales(model_path, num_layers), k_views)
    if kv_cache.dtype != model_dtype:
        return NarrowKVOps(ops, kv_cache, [(1.0, 1.0)] * num_layers, k_views)
    return ops


def store_bf16_rows(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """key, value [T, kv_heads, head_dim] float32 rounded into a bf16 cache's slots in one compiled
    pass (native_rows.c), and returned as the cache holds them (float32, [T, kv_heads, head_dim]);
    None where the compiled library or these layouts do not allow it (nothing is written then)."""
    lib = native_gemv.library()
    tokens, heads, dim = key.shape if key.dim() == 3 else (0, 0, 0)
    rows_dense = all(x.dtype == torch.float32 and x.device.type == "cpu" and x.shape == key.shape
                     and x.stride(2) == 1 and x.stride(1) == dim for x in (key, value))
    if lib is None or not rows_dense or not native_prefill.bf16_blocks_dense(k_cache, v_cache, heads, dim):
        return None
    slots = slot_mapping.to(torch.int64).contiguous()
    k_seen, v_seen = torch.empty(key.shape), torch.empty(value.shape)
    lib.pd_store_kv_bf16(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), tokens, heads * dim,
                         slots.data_ptr(), k_cache.shape[1], k_cache.stride(0), k_cache.data_ptr(),
                         v_cache.data_ptr(), k_seen.data_ptr(), v_seen.data_ptr(), torch.get_num_threads())
    return k_seen, v_seen
