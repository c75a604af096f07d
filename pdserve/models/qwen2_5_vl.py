"""Qwen2.5-VL: the Qwen2 language model with M-RoPE (pdserve.models.mrope), and its vision tower
(pdserve.models.qwen2_5_vl_vision) whose embeddings take the place of the image placeholders.

The checkpoint keeps transformers' names: the language model as model.* and lm_head.*, as a
Qwen2ForCausalLM saves them, the tower as visual.*. So the loader loads the language model as it
loads any Llama-family checkpoint, skipping the tower, and attaches the tower after.
"""
from __future__ import annotations

from pathlib import Path

import torch

from pdserve.models.llama import LlamaModel, ModelSpec
from pdserve.models.mrope import MRopeImages, MRotaryEmbedding
from pdserve.models.qwen2_5_vl_vision import CHECKPOINT_PREFIXES, load_vision_tower

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"


def is_tower_weight(name: str) -> bool:
    return name.startswith(CHECKPOINT_PREFIXES)


class Qwen2_5_VLModel(MRopeImages, LlamaModel):
    """LlamaModel whose positions are [3, T] (M-RoPE) and whose image placeholders take the
    tower's embeddings (forward's images: pdserve.engine.multimodal.ImageRows)."""

    is_multimodal = True
    cuda_graph_safe = False  # the captured decode graphs take 1-D positions

    def __init__(self, spec: ModelSpec, rope: MRotaryEmbedding, multimodal_config, quant_config=None):
        super().__init__(spec, rope, quant_config)
        self.image_token_id = int(multimodal_config.image_token_id)
        self.spatial_merge_size = int(multimodal_config.vision_config.spatial_merge_size)
        self.visual = None  # attached by attach_tower once the language model's weights are in

    def attach_tower(self, multimodal_config, files: list[Path], dtype: torch.dtype, device: torch.device) -> None:
        self.visual = load_vision_tower(multimodal_config, files, dtype, device)


    def native_decode_weights(self) -> str:
        return "the compiled decode step does not take a multimodal model's positions yet"
