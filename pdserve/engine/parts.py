"""What an LLMEngine is made of. pdserve.assembly builds the parts (it picks the executor, the
runner, LoRA, structured outputs); the engine only stores them."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.structured_output import StructuredOutputs
from pdserve.kvstore.layout import KVLayout

if TYPE_CHECKING:  # (annotations only)
    from pdserve.lora.manager import LoRAManager


class Executor(Protocol):
    """Processes that run the model beside this one (pdserve.executor's TP workers)."""

    def close(self) -> None:
        """Stop them."""


@dataclass
class EngineParts:
    config: EngineConfig
    device: torch.device
    model_path: Path
    hf_config: Any
    dtype: torch.dtype
    kv_layout: KVLayout     # K/V per head or an MLA latent: sizes the cache, salts the block keys
    salt: bytes             # the layout's block-key salt
    model: torch.nn.Module  # this process's model (rank 0's shard at TP > 1)
    kv_cache: torch.Tensor
    tokenizer: Any | None   # None: the model directory has none (token ids only)
    max_model_len: int
    pool: BlockPool
    kv: KVCacheManager
    lora: LoRAManager | None
    scheduler: Scheduler
    runner: ModelRunner
    outputs: OutputProcessor
    structured: StructuredOutputs
    executor: Executor | None  # the TP workers, None at tensor_parallel_size 1
    async_scheduling: bool     # overlap a decode step's host work with the device's
