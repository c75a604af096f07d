"""Starting a node's tensor-parallel executor and loading the driver's shard (what
pdserve.assembly.build calls at tensor_parallel_size > 1)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from pdserve.executor.executor import TPExecutor
from pdserve.layers.parallel import set_tp_group
from pdserve.models.loader import FAMILY_MODULES, load_model
from pdserve.models.tp_shard import shard_decoder_model

# Families built from pdserve.layers (sharded as they are built), and families loaded whole
# and then cut to the rank's slice (pdserve.models.tp_shard); the others refuse TP > 1.
LAYER_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SHARDED_AFTER_LOAD = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM",
                      "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
TP_FAMILIES = LAYER_FAMILIES + SHARDED_AFTER_LOAD


def check_tp_support(hf_config, size: int, expert_parallel: bool = False) -> None:
    arch = (getattr(hf_config, "architectures", None) or ["unknown"])[0]
    if arch not in TP_FAMILIES:
        kind = "is not converted to tensor parallelism yet" if arch in FAMILY_MODULES else "is not supported"
        raise ValueError(f"tensor_parallel_size={size}: {arch} {kind}; "
                         f"tensor parallelism supports {', '.join(TP_FAMILIES)}")
    if arch in SHARDED_AFTER_LOAD and getattr(hf_config, "quantization_config", None):
        raise ValueError(f"tensor_parallel_size={size}: quantized {arch} checkpoints (FP8, MXFP4) run at "
                         f"tensor_parallel_size 1 only so far")
    heads = hf_config.num_attention_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the {heads} attention heads")
    if expert_parallel:
        experts = (getattr(hf_config, "num_experts", None) or getattr(hf_config, "n_routed_experts", None)
                   or getattr(hf_config, "num_local_experts", 0))
        if arch not in SHARDED_AFTER_LOAD or not experts:
            raise ValueError(f"enable_expert_parallel: {arch} has no experts to partition")
        if experts % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the {experts} experts")


def rank_threads(config) -> int:
    if config.threads_per_rank:
        return config.threads_per_rank
    return max(1, torch.get_num_threads() // config.tensor_parallel_size)


def start_executor(config, model_path, hf_config, dtype: torch.dtype, device: torch.device,
                   kv_shape: tuple[int, ...]) -> TPExecutor:
    size = config.tensor_parallel_size
    check_tp_support(hf_config, size, config.enable_expert_parallel)
    return TPExecutor(size, os.fspath(model_path), dtype, device, config.kernel_backend, kv_shape,
                      rank_threads(config), expert_parallel=config.enable_expert_parallel)


def load_shard(model_path, hf_config, dtype: torch.dtype, device: torch.device, group, expert_parallel: bool):
    """This rank's shard of the model (the driver's and every worker's)."""
    set_tp_group(group)
    try:
        model = load_model(Path(model_path), hf_config, dtype, device)
    finally:
        set_tp_group(None)  # another engine in this process builds unsharded unless it sets its own
    if hf_config.architectures[0] in SHARDED_AFTER_LOAD:
        shard_decoder_model(model, group, expert_parallel)
    return model


def load_driver_shard(executor: TPExecutor, model_path, hf_config, dtype: torch.dtype, device: torch.device):
    """Rank 0's shard, built with the TP group set (layers read it as they are built), then wait
    for the workers' shards."""
    model = load_shard(model_path, hf_config, dtype, device, executor.group, executor.expert_parallel)
    executor.wait_ready()
    return model
