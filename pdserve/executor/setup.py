"""Starting a node's tensor-parallel executor and loading the driver's shard (LLMEngine's
entry points at tensor_parallel_size > 1)."""
from __future__ import annotations

import os

import torch

from pdserve.executor.executor import TPExecutor
from pdserve.layers.parallel import set_tp_group
from pdserve.models.loader import FAMILY_MODULES, load_model

# Families built from pdserve.layers (sharded by their layers); the others refuse TP > 1.
TP_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def check_tp_support(hf_config, size: int) -> None:
    arch = (getattr(hf_config, "architectures", None) or ["unknown"])[0]
    if arch not in TP_FAMILIES:
        kind = "is not converted to tensor parallelism yet" if arch in FAMILY_MODULES else "is not supported"
        raise ValueError(f"tensor_parallel_size={size}: {arch} {kind}; "
                         f"tensor parallelism supports {', '.join(TP_FAMILIES)}")
    heads = hf_config.num_attention_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the {heads} attention heads")


def rank_threads(config) -> int:
    if config.threads_per_rank:
        return config.threads_per_rank
    return max(1, torch.get_num_threads() // config.tensor_parallel_size)


def start_executor(config, model_path, hf_config, dtype: torch.dtype, device: torch.device,
                   kv_shape: tuple[int, ...]) -> TPExecutor:
    size = config.tensor_parallel_size
    check_tp_support(hf_config, size)
    threads = rank_threads(config)
    kernel_backend = config.kernel_backend
    return TPExecutor(size, os.fspath(model_path), dtype, device, kernel_backend, kv_shape, threads)


def load_driver_shard(executor: TPExecutor, model_path, hf_config, dtype: torch.dtype, device: torch.device):
    """Rank 0's shard, built with the TP group set (layers read it as they are built), then wait
    for the workers' shards."""
    set_tp_group(executor.group)
    try:
        model = load_model(model_path, hf_config, dtype, device)
    finally:
        set_tp_group(None)  # another engine in this process builds unsharded unless it sets its own
    executor.wait_ready()
    return model
