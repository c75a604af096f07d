"""What is decided once, as an engine is built, from its config and model: the device, the KV
cache's size, the longest request, the kernels, the LoRA manager, whether the FP8 cache, CUDA
graphs and async scheduling apply, the sliding-window bound on blocks, the tokenizer and the EOS
ids."""
from __future__ import annotations

import logging
import math

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_pool_size import default_num_blocks
from pdserve.engine.state_pool import StatePool, slot_nbytes
from pdserve.engine.state_snapshots import StateSnapshots
from pdserve.executor.kv_shared import state_layers
from pdserve.kernels import get_ops
from pdserve.kernels.dequant_tiles import gemm_dtype, native_amx
from pdserve.kernels.fp8_kv import narrow_kv_ops
from pdserve.kvstore.layout import KVLayout
from pdserve.lora.manager import LoRAManager
from pdserve.models.hybrid import unsupported_for_hybrid
from pdserve.models.model_path import eos_token_ids, load_decode_tokenizer
from pdserve.models.model_path import load_tokenizer as load_checkpoint_tokenizer
from pdserve.models.tp_shard_hybrid import HYBRID_TP_FAMILIES

log = logging.getLogger(__name__)

STEP_TOKENS = 2048  # a step's tokens by default (vLLM's CPU server's default too)
# ... where a CPU's products run int8 without AMX (VNNI at every row count: a GGUF on Zen 4 or 5),
# a step's cost grows with its tokens from the first (the default GGUF on a 2-core Zen 5, one
# process: 160 tokens 47.5 ms, 2,080 tokens 611 ms), so smaller chunks cost nothing and a burst's
# first prompts finish sooner: served beside 2,048 (2026-12-06, medians of 5), TTFT p50 at 32
# streams 1,528 -> 1,265 ms, TPOT p50 28.0 -> 32.9 ms, tokens/s the same; at 128 the same TTFT
# (docs/benchmarks/vs-vllm.md, Zen 5). The same for bf16 products over weights that are not
# quantized (oneDNN's products on a bf16 copy made once and kept). Measured on a bf16 checkpoint,
# served beside 2,048 (2026-12-07, medians of 3): TTFT p50 at 32 streams 1,510 -> 1,101 ms, at
# 128 4,326 -> 3,986, tokens/s within the runs' spread.
# AMX's tiles dequantize every matrix a step (~47 ms on the Xeon VM), and so do bf16 products over
# quantized weights anywhere: larger steps there.
STEP_TOKENS_LINEAR_CPU = 1024


def pick_device(config: EngineConfig) -> torch.device:
    if config.device != "auto":
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def step_tokens(config: EngineConfig, device: torch.device, quantized: bool) -> int:
    """config.max_num_batched_tokens, or the default for this device and its products (set_tile_dtype's);
    quantized: the checkpoint's weights are (a GGUF's blocks, a quantization_config's)."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    products = gemm_dtype()
    linear = (device.type == "cpu" and not native_amx()
              and (products == torch.int8 or (products == torch.bfloat16 and not quantized)))
    return STEP_TOKENS_LINEAR_CPU if linear else STEP_TOKENS


def num_kv_blocks(config: EngineConfig, layout: KVLayout, max_positions: int) -> int:
    """config's block count, else its memory budget's, else the default pool (engine.kv_pool_size)."""
    bytes_per_block = layout.block_nbytes()
    if config.num_kv_blocks:
        n = config.num_kv_blocks
    elif config.kv_cache_memory_gb is not None:
        n = int(config.kv_cache_memory_gb * 2**30 // bytes_per_block)
    else:
        n = default_num_blocks(bytes_per_block, config.block_size, config.max_num_seqs,
                               config.max_model_len or max_positions)
    log.info("KV cache: %d blocks of %d tokens (%.1f MiB)", n, config.block_size, n * bytes_per_block / 2**20)
    return n


def check_hybrid_supported(config: EngineConfig, hf_config) -> None:
    """Refuse, before anything loads, the settings not implemented for a hybrid model."""
    arch = (getattr(hf_config, "architectures", None) or ["this model"])[0]
    refused = unsupported_for_hybrid(config, arch, HYBRID_TP_FAMILIES)
    if refused:
        raise ValueError(f"{arch} is a hybrid model (linear-attention or Mamba layers with a recurrent state); "
                         "pdserve does not support these with it yet: " + "; ".join(refused))


def state_pool(config: EngineConfig, model, layout: KVLayout, blocks: int, device: torch.device,
               executor=None) -> tuple[StatePool, StateSnapshots | None, int]:
    """A hybrid model's state pool, one slot per request that may run at once (max_num_seqs);
    with prefix caching, as many snapshots of states at block boundaries (state_snapshots); and
    the KV block count left beside them: a memory budget (kv_cache_memory_gb, or the default
    pool's) holds them all, an explicit num_kv_blocks is kept as given. executor: a
    tensor-parallel node's, whose ranks share the slots' arena (TPExecutor.map_states)."""
    spec = model.state_spec()
    copies = config.max_num_seqs * (2 if config.enable_prefix_caching else 1)
    state_bytes = copies * slot_nbytes(spec)
    if not config.num_kv_blocks:
        budget_blocks = blocks
        blocks -= math.ceil(state_bytes / layout.block_nbytes())
        if blocks < 1:
            raise ValueError(f"the KV memory budget ({budget_blocks} blocks) cannot hold the recurrent-state pool "
                             f"({copies} slots of {len(spec)} layers, {state_bytes / 2**20:.1f} MiB) "
                             "and one KV block: raise kv_cache_memory_gb or lower max_num_seqs")
    log.info("state pool: %d slots of %d layers, with snapshots (%.1f MiB)", copies, len(spec), state_bytes / 2**20)
    arena = None
    if executor is not None:
        arena = executor.map_states(state_layers(spec), config.max_num_seqs, slot_nbytes(spec))
    pool = StatePool(spec, config.max_num_seqs, device, arena=arena)
    snapshots = StateSnapshots(pool, config.max_num_seqs, device) if config.enable_prefix_caching else None
    return pool, snapshots, blocks


def max_model_len(config: EngineConfig, hf_config, model, num_blocks: int) -> int:
    """The longest request: the model's positions (or max_model_len past them, when allowed), the
    cache, and a sliding window the model's attention does not apply itself."""
    limit = min(model_positions(config, model), num_blocks * config.block_size)
    window = getattr(hf_config, "sliding_window", None)
    if getattr(model, "handles_sliding_window", False):
        window = None  # the model's attention applies its windows itself
    if window and getattr(hf_config, "use_sliding_window", True):
        limit = min(limit, window)  # sliding-window attention is not implemented: stay inside it
    return min(config.max_model_len or limit, limit)


def model_positions(config: EngineConfig, model) -> int:
    """The positions the engine runs: the config's max_position_embeddings, or a longer
    max_model_len under allow_long_max_model_len (refused without it, as vLLM refuses it)."""
    positions, wanted = model.spec.max_position_embeddings, config.max_model_len
    if not wanted or wanted <= positions:
        return positions
    if not config.allow_long_max_model_len:
        raise ValueError(f"max_model_len {wanted} is more than the model's max_position_embeddings {positions}; "
                         "allow_long_max_model_len (--allow-long-max-model-len) serves it anyway, with RoPE past "
                         "the positions the model was trained on")
    if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1 or config.speculative_config:
        raise ValueError("allow_long_max_model_len: not supported with tensor or pipeline parallelism or "
                         "speculative decoding yet (their models' RoPE tables stop at max_position_embeddings)")
    return wanted


def kernel_ops(config: EngineConfig, device: torch.device, kv_cache: torch.Tensor, model_path, num_layers: int,
               model_dtype: torch.dtype = torch.float32, warm_up: bool = True):
    """The attention kernels (warmed up, unless warm_up is False: a node that decodes nothing
    until it switches roles loads the decode kernel at its first decode step instead), wrapped for
    an FP8 cache with the checkpoint's scales, or a bf16 cache under a float32 model."""
    ops = get_ops(config.kernel_backend, device.type)
    if warm_up and hasattr(ops, "warm_up"):
        ops.warm_up()
    return narrow_kv_ops(ops, kv_cache, model_dtype, model_path, num_layers)


def start_lora(config: EngineConfig, model, dtype: torch.dtype, device: torch.device):
    """The engine's LoRAManager with config.lora_modules registered; None when adapters are off."""
    if not config.enable_lora:
        return None
    manager = LoRAManager(model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, dtype, device)
    for name, path in (config.lora_modules or {}).items():
        manager.add(name, path)
    return manager


def check_fp8_kv_supported(config: EngineConfig, layout: KVLayout) -> None:
    """The FP8 or bf16 cache wraps the K/V attention ops (of the driver and of each TP worker):
    MLA's latent cache does not go through them."""
    if layout.planes != 2:
        raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype} is not supported for MLA models (their latent cache)")


def kv_window(model) -> int:
    """The window past which a block can be freed: > 0 only when every attention layer slides
    (then the widest window); 0 when any layer attends to the whole context, which needs
    every block."""
    windows = [getattr(getattr(layer, "self_attn", None), "window", 0) or 0 for layer in model.layers]
    return max(windows) if windows and min(windows) > 0 else 0


def drafts_from_hidden(config: EngineConfig) -> bool:
    """An EAGLE or MTP head reads every step's hidden states: no CUDA graphs (they give logits only)."""
    spec = config.speculative_config
    return spec is not None and spec.method in ("eagle", "mtp")


def use_async_scheduling(setting, device: torch.device) -> bool:
    """auto: on CUDA, where the host's work can hide behind the GPU's; on the CPU the host is
    the device, so there is nothing to overlap."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def load_tokenizer(path, decode_only: bool = False):
    """The checkpoint's tokenizer; decode_only (a node, which never tokenizes): its snapshot when
    an earlier load left one, which decodes alike without importing transformers."""
    try:
        if decode_only:
            return load_decode_tokenizer(path)
        return load_checkpoint_tokenizer(path)  # the router's loader too: both tokenize alike
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer in %s (%s): text prompts and output text are unavailable", path, exc)
        return None


def eos_ids(hf_config, tokenizer) -> set[int]:
    return eos_token_ids(hf_config, tokenizer)  # (the router's rule too: one place)
