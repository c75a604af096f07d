"""Qwen3.5 with images (Qwen3_5ForConditionalGeneration): the Qwen3.5 hybrid language model
(pdserve.models.qwen3_5: Gated DeltaNet and gated attention layers) whose image placeholder
tokens take the embeddings of its vision tower (pdserve.models.qwen3_5_vision), with
Qwen2.5-VL's multimodal positions (pdserve.models.mrope: three per token, the same prompt
positions and decode delta).

What differs from Qwen2.5-VL's M-RoPE: the sections are interleaved, not contiguous. Of the
rotated part's frequencies (partial_rotary_factor of the head), frequency j takes the row's
position when j % 3 == 1 and j < 3 * mrope_section[1], the column's when j % 3 == 2 and
j < 3 * mrope_section[2], and the temporal one otherwise (transformers 5.24's
Qwen3_5TextRotaryEmbedding.recomposition_frequencies). A text token has one position on all
three axes, so a prompt without images rotates as the text model does.

The checkpoint keeps transformers' names: model.language_model.* and lm_head.* for the language
model, model.visual.* for the tower. Only images: videos are refused by the image path.
"""
from __future__ import annotations

from pathlib import Path

import torch

from pdserve.models import qwen3_5
from pdserve.models.hybrid import HybridDecoderModel
from pdserve.models.mrope import MRopeImages, MRotaryEmbedding
from pdserve.models.qwen3_5_vision import load_vision_tower, vision_spec
from pdserve.models.rope import RotaryEmbedding

ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
DEFAULT_MROPE_SECTION = (11, 11, 10)  # transformers' default when rope_parameters names none


def mrope_section(config) -> list[int]:
    return list((config.rope_parameters or {}).get("mrope_section") or DEFAULT_MROPE_SECTION)


def check_config(config) -> None:
    """config: the text config standing for the model (loader.flatten_multimodal_config)."""
    qwen3_5.check_config(config)
    vision_spec(config.multimodal_config.vision_config)
    section = mrope_section(config)
    if len(section) != 3:
        raise ValueError(f"rope_parameters.mrope_section {section} must have 3 parts")


class InterleavedMRotaryEmbedding(MRotaryEmbedding):
    """MRotaryEmbedding whose three axes take interleaved frequencies (the module docstring)."""

    def __init__(self, hf_text_config, rotary_dim: int, max_positions: int):
        RotaryEmbedding.__init__(self, hf_text_config, rotary_dim, max_positions)
        height, width = mrope_section(hf_text_config)[1:]
        j = torch.arange(rotary_dim // 2)
        axis = torch.zeros_like(j)
        axis[(j % 3 == 1) & (j < 3 * height)] = 1
        axis[(j % 3 == 2) & (j < 3 * width)] = 2
        self._axis = torch.cat([axis, axis])  # the rotate-half layout repeats the frequencies


class Qwen35VLModel(MRopeImages, HybridDecoderModel):
    """The hybrid decoder whose positions are [3, T] and whose image placeholders take the
    tower's embeddings (forward's images: pdserve.engine.multimodal.ImageRows)."""

    is_multimodal = True



def build_model(config, files: list[Path], dtype: torch.dtype, device: torch.device) -> Qwen35VLModel:
    mm = config.multimodal_config
    rope = InterleavedMRotaryEmbedding(config, qwen3_5.rotary_dim(config), config.max_position_embeddings)
    model = qwen3_5.build_model(config, files, dtype, device, model_class=Qwen35VLModel, rope=rope)
    model.image_token_id = int(mm.image_token_id)
    model.spatial_merge_size = int(mm.vision_config.spatial_merge_size)
    model.visual = load_vision_tower(mm.vision_config, files, dtype, device)
    return model
