"""Starting a node's executor and loading the driver's shard (what pdserve.assembly.build
calls at tensor_parallel_size > 1 or pipeline_parallel_size > 1)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from pdserve.executor.executor import TPExecutor
from pdserve.kernels.dequant_tiles import gemm_dtype
from pdserve.layers.parallel import set_tp_group
from pdserve.layers.quant.base import quantization_dict
from pdserve.models import qwen2_5_vl
from pdserve.models.hybrid import is_hybrid_config
from pdserve.models.loader import FAMILY_MODULES, load_model
from pdserve.models.pipeline import cut_to_stage, pp_layer_range
from pdserve.models.tp_shard import shard_decoder_model
from pdserve.models.tp_shard_hybrid import HYBRID_TP_FAMILIES, shard_hybrid_model

# Families built from pdserve.layers (sharded as they are built), and families loaded whole
# and then cut to the rank's slice (pdserve.models.tp_shard, tp_shard_hybrid for the hybrids
# with linear-attention or Mamba2 layers); the others refuse TP > 1.
LAYER_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                  qwen2_5_vl.ARCHITECTURE)
SHARDED_AFTER_LOAD = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM",
                      "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Gemma3ForCausalLM")
TP_FAMILIES = LAYER_FAMILIES + SHARDED_AFTER_LOAD + HYBRID_TP_FAMILIES


# Quantized checkpoints of the families sharded after load that are cut like float ones: MXFP4
# experts (whole ones under expert parallelism, or each one's intermediate slice in groups of
# 32), and FP8 blocks (every layer's rows with their scales, columns in whole blocks of 128).
SHARDED_QUANT_METHODS = ("mxfp4", "fp8")


def check_tp_support(hf_config, size: int, expert_parallel: bool = False) -> None:
    arch = (getattr(hf_config, "architectures", None) or ["unknown"])[0]
    if arch not in TP_FAMILIES:
        kind = "is not converted to tensor parallelism yet" if arch in FAMILY_MODULES else "is not supported"
        raise ValueError(f"tensor_parallel_size={size}: {arch} {kind}; "
                         f"tensor parallelism supports {', '.join(TP_FAMILIES)}")
    quant = quantization_dict(hf_config)
    if arch in SHARDED_AFTER_LOAD and quant and quant.get("quant_method") not in SHARDED_QUANT_METHODS:
        raise ValueError(f"tensor_parallel_size={size}: quantized {arch} checkpoints other than "
                         f"{' and '.join(SHARDED_QUANT_METHODS)} run at tensor_parallel_size 1 only so far")
    heads = hf_config.num_attention_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the {heads} attention heads")
    if arch in HYBRID_TP_FAMILIES:  # the linear-attention and Mamba2 heads, Mamba2's groups (split whole)
        for field in ("linear_num_key_heads", "linear_num_value_heads", "mamba_num_heads", "mamba_n_heads",
                      "n_groups", "mamba_n_groups"):
            count = getattr(hf_config, field, None)
            if count and count % size:
                raise ValueError(f"tensor_parallel_size={size} does not divide {field} ({count})")
    if expert_parallel:
        experts = (getattr(hf_config, "num_experts", None) or getattr(hf_config, "n_routed_experts", None)
                   or getattr(hf_config, "num_local_experts", 0))
        if arch not in SHARDED_AFTER_LOAD or not experts:
            raise ValueError(f"enable_expert_parallel: {arch} has no experts to partition")
        if experts % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the {experts} experts")


def check_pp_support(hf_config, size: int) -> None:
    """Pipeline stages run the families tensor parallelism runs, text only, with a layer each."""
    arch = (getattr(hf_config, "architectures", None) or ["unknown"])[0]
    if getattr(hf_config, "multimodal_config", None) is not None:
        raise ValueError(f"pipeline_parallel_size={size}: {arch} takes images, which pipeline stages do not "
                         "pass on yet; run it with tensor_parallel_size instead")
    if arch not in TP_FAMILIES:
        raise ValueError(f"pipeline_parallel_size={size}: {arch} is not split into pipeline stages yet; "
                         f"pipeline parallelism supports {', '.join(TP_FAMILIES)}")
    pp_layer_range(hf_config.num_hidden_layers, 0, size)  # refuses more stages than layers


def rank_threads(config) -> int:
    if config.threads_per_rank:
        return config.threads_per_rank
    return max(1, torch.get_num_threads() // (config.tensor_parallel_size * config.pipeline_parallel_size))


def start_executor(config, model_path, hf_config, dtype: torch.dtype, device: torch.device,
                   kv_shape: tuple[int, ...], kv_dtype: torch.dtype | None = None) -> TPExecutor:
    size, stages = config.tensor_parallel_size, config.pipeline_parallel_size
    if size > 1:
        check_tp_support(hf_config, size, config.enable_expert_parallel)
    if stages > 1:
        check_pp_support(hf_config, stages)
    return TPExecutor(size, os.fspath(model_path), dtype, device, config.kernel_backend, kv_shape,
                      rank_threads(config), expert_parallel=config.enable_expert_parallel, pp_size=stages,
                      lora_slots=(config.max_loras, config.max_lora_rank) if config.enable_lora else (0, 0),
                      kv_dtype=kv_dtype, gemm_dtype=str(gemm_dtype()).removeprefix("torch."),
                      kv_prefault=config.kv_cache_prefault, states=is_hybrid_config(hf_config))


def load_shard(model_path, hf_config, dtype: torch.dtype, device: torch.device, group, expert_parallel: bool,
               stage: int = 0, num_stages: int = 1):
    """This rank's shard of the model (the driver's and every worker's): its TP slice, cut to its
    pipeline stage's layers (loaded whole, then the other stages' layers dropped). A
    vision-language model's tower is rank 0's only: it encodes, and sends the embeddings."""
    set_tp_group(group)
    try:
        model = load_model(Path(model_path), hf_config, dtype, device, vision_tower=group.rank == 0)
    finally:
        set_tp_group(None)  # another engine in this process builds unsharded unless it sets its own
    if hf_config.architectures[0] in SHARDED_AFTER_LOAD and group.size > 1:
        shard_decoder_model(model, group, expert_parallel)
    elif hf_config.architectures[0] in HYBRID_TP_FAMILIES and group.size > 1:
        shard_hybrid_model(model, group)
    return cut_to_stage(model, stage, num_stages) if num_stages > 1 else model


def load_driver_shard(executor: TPExecutor, model_path, hf_config, dtype: torch.dtype, device: torch.device):
    """Rank 0's shard, built with the TP group set (layers read it as they are built), then wait
    for the workers' shards."""
    model = load_shard(model_path, hf_config, dtype, device, executor.group, executor.expert_parallel,
                       0, executor.pp_size)
    executor.wait_ready()
    return model
