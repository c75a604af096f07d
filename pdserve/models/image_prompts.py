"""A vision-language model's prompts with images: the model's own transformers image processor
turns each picture into pixels, and each image placeholder token of the tokenized prompt is
expanded into as many tokens as the vision tower gives embeddings (what transformers' processor
does to the text, done here on token ids so the router and the offline API tokenize once).

Used by the router and the offline API; the engine receives the expanded prompt and the
ImageInputs. The image processor classes are transformers' PIL ones (no torchvision); importing
transformers imports torch, so a router serving a vision-language model loads torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pdserve.protocol.multimodal import ImageInput, make_image_input

QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
MULTIMODAL_ARCHITECTURES = (QWEN2_5_VL,)


class ImagePrompts:
    """expand(prompt ids with one placeholder token per image, PIL images) -> (expanded ids,
    ImageInputs)."""

    def __init__(self, processor, image_token_id: int, merge_size: int):
        self.processor = processor
        self.image_token_id = image_token_id
        self.merge_size = merge_size

    @classmethod
    def for_model(cls, path: Path, config) -> ImagePrompts | None:
        """The model's image prompts, or None for a text model. config: its config.json's fields
        (as attributes)."""
        archs = getattr(config, "architectures", None) or []
        if not archs or archs[0] not in MULTIMODAL_ARCHITECTURES:
            return None
        # deferred: transformers (and so torch) only for a vision-language model
        from transformers import Qwen2VLImageProcessorPil
        processor = Qwen2VLImageProcessorPil.from_pretrained(str(path))
        vision = config.vision_config
        merge = vision["spatial_merge_size"] if isinstance(vision, dict) else vision.spatial_merge_size
        return cls(processor, int(config.image_token_id), int(merge))

    def placeholder_count(self, prompt_token_ids: Sequence[int]) -> int:
        return sum(1 for t in prompt_token_ids if t == self.image_token_id)

    def expand(self, prompt_token_ids: Sequence[int], images: Sequence) -> tuple[list[int], list[ImageInput]]:
        """ValueError when the prompt's placeholders and the images do not pair up."""
        found = self.placeholder_count(prompt_token_ids)
        if found != len(images):
            raise ValueError(f"the prompt has {found} image placeholders for {len(images)} images")
        out: list[int] = []
        inputs: list[ImageInput] = []
        pictures = iter(images)
        for token in prompt_token_ids:
            if token != self.image_token_id:
                out.append(token)
                continue
            pixels, grid = self._preprocess(next(pictures))
            length = int(np.prod(grid)) // self.merge_size ** 2
            inputs.append(make_image_input(pixels, len(out), length, grid))
            out.extend([self.image_token_id] * length)
        return out, inputs

    def _preprocess(self, image) -> tuple[np.ndarray, list[int]]:
        batch = self.processor(images=[image.convert("RGB")], return_tensors="np")
        return batch["pixel_values"], [int(v) for v in batch["image_grid_thw"][0]]
