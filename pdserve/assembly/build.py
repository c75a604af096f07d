"""build_engine: an LLMEngine put together from its config. Here the executor is picked (the
model in this process, or sharded over tensor-parallel workers: pdserve.executor), with the
runner that goes with it, LoRA, structured outputs and speculation (pdserve.spec_decode)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.assembly.pool_pages import WriteAhead, zeroed_pool
from pdserve.assembly.setup import (
    check_fp8_kv_supported,
    check_hybrid_supported,
    drafts_from_hidden,
    eos_ids,
    kernel_ops,
    kv_window,
    load_tokenizer,
    max_model_len,
    num_kv_blocks,
    pick_device,
    start_lora,
    state_pool,
    step_tokens,
    use_async_scheduling,
)
from pdserve.assembly.speculation import make_speculator
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.multimodal import EncoderCache, MultiModalInputs
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.parts import EngineParts
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.state_pool import StatePool
from pdserve.engine.state_snapshots import StateSnapshots
from pdserve.engine.structured_output import StructuredOutputs
from pdserve.executor.executor import TPExecutor
from pdserve.executor.pipeline_runner import PipelineModelRunner
from pdserve.executor.runner import TPModelRunner
from pdserve.executor.setup import load_driver_shard, start_executor
from pdserve.kernels.dequant_tiles import gemm_dtype, resolve_gemm_dtype, set_tile_dtype
from pdserve.kernels.fp8_kv import kv_cache_torch_dtype
from pdserve.kernels.host_memory import keep_large_allocations
from pdserve.kvstore.layout import KVLayout
from pdserve.layers.quant.base import quantization_dict
from pdserve.models.gguf import checkpoint_name, is_gguf_view
from pdserve.models.hybrid import is_hybrid_config
from pdserve.models.loader import default_dtype, load_hf_config, load_model, resolve_model_path
from pdserve.models.model_path import context_limit
from pdserve.models.rope import cover_positions
from pdserve.protocol.block_keys import kv_entry_dims


def build_engine(config: EngineConfig, role: str | None = None) -> LLMEngine:
    """The engine for config: the model loaded, its cache allocated, speculation attached. role:
    the node it serves (None: the offline LLM). A node only decodes text (the router tokenizes),
    and a prefill or encode node runs no decode step until it switches roles."""
    target = _load_target(config)
    engine = LLMEngine(_parts(config, target, role))
    if config.speculative_config is not None:
        engine.attach_speculator(make_speculator(config.speculative_config, engine))
    return engine


DEFAULT_CONTEXT = 8192  # the longest request, for a config that names none (bounds the default KV pool)

@dataclass
class _Target:
    """The model as loaded, with its paged KV cache (and its TP workers, if any)."""
    device: torch.device
    model_path: Path
    hf_config: Any
    dtype: torch.dtype
    kv_layout: KVLayout
    model: torch.nn.Module
    kv_cache: torch.Tensor
    executor: TPExecutor | None
    states: StatePool | None = None  # a hybrid model's recurrent-state slots
    snapshots: StateSnapshots | None = None  # ... and their copies at block boundaries (prefix caching)


def _load_target(config: EngineConfig) -> _Target:
    device = pick_device(config)
    model_path = resolve_model_path(config.model)
    # this process's products (and its TP workers'); auto takes llama.cpp's int8 for a GGUF's blocks
    gguf = is_gguf_view(model_path)
    set_tile_dtype(resolve_gemm_dtype(config.cpu_gemm_dtype, gguf=gguf))
    if device.type == "cpu":
        keep_large_allocations()
    hf_config = load_hf_config(model_path)
    config.max_num_batched_tokens = step_tokens(config, device, gguf or quantization_dict(hf_config) is not None)
    hybrid = is_hybrid_config(hf_config)
    if hybrid:
        check_hybrid_supported(config, hf_config)
    dtype = default_dtype(config.dtype, device)
    # K/V per head, or one latent per token for MLA: sizes the cache and salts its block keys
    # (the same at every TP degree: the cache holds every KV head, see pdserve.executor).
    # The KV dtype, not the model's, goes in the layout and so in the block-key salt: an FP8
    # node and a full-width node never share a block (pdserve.kernels.fp8_kv).
    kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, auto_kv_dtype(dtype, device, hf_config, hybrid))
    layout = KVLayout.for_model(hf_config, config.block_size, kv_dtype, checkpoint_name(config.model, model_path))
    if kv_dtype != dtype:
        check_fp8_kv_supported(config, layout)
    # the longest request bounds the default pool (a vision-language model's text config has it)
    blocks = num_kv_blocks(config, layout, context_limit(getattr(hf_config, "text_config", None) or hf_config)
                           or DEFAULT_CONTEXT)
    if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
        executor = start_executor(config, model_path, hf_config, dtype, device,
                                  (blocks, *layout.block_shape()), layout.dtype)
        model = load_driver_shard(executor, model_path, hf_config, dtype, device)
        states = snapshots = None
        kv_cache = executor.kv_cache
        if hybrid:  # the slots come out of the budget: the pool's blocks past `blocks` stay unwritten
            states, snapshots, blocks = state_pool(config, model, layout, blocks, device, executor)
            kv_cache = kv_cache[:blocks]
        return _Target(device, model_path, hf_config, dtype, layout, model, kv_cache, executor, states, snapshots)
    model = load_model(model_path, hf_config, dtype, device)
    states = snapshots = None
    if hybrid:
        states, snapshots, blocks = state_pool(config, model, layout, blocks, device)
    kv_cache = zeroed_pool((blocks, *layout.block_shape()), layout.dtype, device, config.kv_cache_prefault)
    return _Target(device, model_path, hf_config, dtype, layout, model, kv_cache, None, states, snapshots)


def auto_kv_dtype(dtype: torch.dtype, device: torch.device, hf_config, hybrid: bool) -> torch.dtype:
    """What kv_cache_dtype auto holds: the model's dtype, but bf16 on a CPU whose products run in
    bf16 or int8 (cpu_gemm_dtype), as vLLM's CPU backend keeps a bf16 model's cache and llama.cpp
    an f16 one: a decode step reads half the bytes. K/V caches only (not MLA's latent cache, nor
    a hybrid model's), from a float32 model."""
    low = device.type == "cpu" and dtype == torch.float32 and gemm_dtype() != torch.float32
    if not low or hybrid or kv_entry_dims(hf_config)[0] != 2:
        return dtype
    return torch.bfloat16


def multimodal_inputs(model, encoder_cache_tokens: int) -> MultiModalInputs | None:
    """A vision-language model's image inputs and encoder cache; None for a text model."""
    if not getattr(model, "is_multimodal", False):
        return None
    return MultiModalInputs(model, EncoderCache(encoder_cache_tokens))


def _parts(config: EngineConfig, t: _Target, role: str | None = None) -> EngineParts:
    tokenizer = load_tokenizer(t.model_path, decode_only=role is not None)
    max_len = max_model_len(config, t.hf_config, t.model, t.kv_cache.shape[0])
    cover_positions(t.model, max_len)  # past max_position_embeddings only when allowed (model_positions)
    salt = t.kv_layout.salt()
    pool = BlockPool(t.kv_cache.shape[0], config.enable_prefix_caching)
    if t.device.type == "cpu" and t.executor is None and not config.kv_cache_prefault:
        pool.fresh_hook = WriteAhead(t.kv_cache)  # the pool's pages written just ahead of use
    whole_images = bool(getattr(t.model, "bidirectional_images", False))
    kv = KVCacheManager(pool, config.block_size, salt, kv_window(t.model), whole_images, t.states, t.snapshots)
    lora = start_lora(config, t.model, t.dtype, t.device)
    ops = kernel_ops(config, t.device, t.kv_cache, t.model_path, t.kv_layout.num_layers, t.dtype,
                     warm_up=role not in ("prefill", "encode"))
    if whole_images and not getattr(ops, "PREFILL_KEY_ENDS", False):
        raise ValueError(f"{t.hf_config.architectures[0]}'s image tokens attend bidirectionally, which only the "
                         "torch and numba kernel backends implement so far (kernel_backend='torch'), with a "
                         "bfloat16/float32 KV cache")
    if t.executor is not None:
        if t.executor.pp_size > 1:
            runner = PipelineModelRunner(t.model, t.executor, config.block_size, ops, t.device, t.dtype,
                                         lora_batch=lora.batch if lora is not None else None)
        else:
            runner = TPModelRunner(t.model, t.executor, config.block_size, ops, t.device,
                                   lora_batch=lora.batch if lora is not None else None,
                                   multimodal=multimodal_inputs(t.model, config.encoder_cache_tokens),
                                   states=t.states)
        if lora is not None:  # the workers load each adapter into the slot the driver does
            lora.on_load = t.executor.load_lora
    else:
        runner = ModelRunner(t.model, t.kv_cache, config.block_size, ops, t.device,
                             max_num_seqs=config.max_num_seqs, max_model_len=max_len,
                             use_cuda_graphs=(not config.enforce_eager and lora is None
                                              and not drafts_from_hidden(config)),
                             lora_batch=lora.batch if lora is not None else None,
                             multimodal=multimodal_inputs(t.model, config.encoder_cache_tokens),
                             states=t.states)
    scheduler = Scheduler(config, kv, lora)
    if runner.multimodal is not None:  # encoding counts against the step's prefill
        scheduler.uncached_images = runner.multimodal.uncached_images
    outputs = OutputProcessor(tokenizer, eos_ids(t.hf_config, tokenizer), max_len)
    structured = StructuredOutputs(tokenizer, t.model.spec.vocab_size, outputs.eos_token_ids)
    # (Speculation needs each step's tokens on the host to draft the next: no overlap. A hybrid
    # model's state snapshot is taken as its step is collected, which must come before the next
    # step updates the slot: no overlap either.)
    async_scheduling = (t.executor is None and config.speculative_config is None and t.states is None
                        and use_async_scheduling(config.async_scheduling, t.device))
    return EngineParts(config, t.device, t.model_path, t.hf_config, t.dtype, t.kv_layout, salt, t.model, t.kv_cache,
                       tokenizer, max_len, pool, kv, lora, scheduler, runner, outputs, structured,
                       t.executor, async_scheduling)
