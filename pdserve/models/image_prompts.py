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

from pdserve.models.model_path import load_tokenizer
from pdserve.protocol.multimodal import ImageInput, make_image_input

QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
QWEN3_5 = "Qwen3_5ForConditionalGeneration"  # Qwen2.5-VL's image processor and placeholders
GEMMA3 = "Gemma3ForConditionalGeneration"
MULTIMODAL_ARCHITECTURES = (QWEN2_5_VL, QWEN3_5, GEMMA3)


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
        if archs[0] == GEMMA3:
            return Gemma3ImagePrompts.for_gemma3(path, config)
        # deferred: transformers (and so torch) only for a vision-language model
        from transformers import Qwen2VLImageProcessorPil
        processor = Qwen2VLImageProcessorPil.from_pretrained(str(path))
        vision = config.vision_config
        merge = vision["spatial_merge_size"] if isinstance(vision, dict) else vision.spatial_merge_size
        return cls(processor, int(config.image_token_id), int(merge))

    @property
    def placeholder(self) -> int:
        """The token that marks an image in the tokenized prompt (one per image)."""
        return self.image_token_id

    def placeholder_count(self, prompt_token_ids: Sequence[int]) -> int:
        return sum(1 for t in prompt_token_ids if t == self.placeholder)

    def expand(self, prompt_token_ids: Sequence[int], images: Sequence) -> tuple[list[int], list[ImageInput]]:
        """ValueError when the prompt's placeholders and the images do not pair up."""
        found = self.placeholder_count(prompt_token_ids)
        if found != len(images):
            raise ValueError(f"the prompt has {found} image placeholders for {len(images)} images")
        out: list[int] = []
        inputs: list[ImageInput] = []
        pictures = iter(images)
        for token in prompt_token_ids:
            if token == self.placeholder:
                inputs.append(self._place(next(pictures), out))
            else:
                out.append(token)
        return out, inputs

    def _place(self, picture, out: list[int]) -> ImageInput:
        """Appends the image's tokens to the expanded prompt `out`; its ImageInput."""
        batch = self.processor(images=[picture.convert("RGB")], return_tensors="np")
        grid = [int(v) for v in batch["image_grid_thw"][0]]
        length = int(np.prod(grid)) // self.merge_size ** 2
        image = make_image_input(batch["pixel_values"], len(out), length, grid)
        out.extend([self.image_token_id] * length)
        return image


class Gemma3ImagePrompts(ImagePrompts):
    """Gemma 3: each <start_of_image> ("boi") of the prompt becomes what transformers'
    Gemma3Processor puts in its place, "\n\n<start_of_image>" + mm_tokens_per_image x
    <image_soft_token> + "<end_of_image>\n\n", here on token ids (the blank lines tokenized
    alone: a tokenizer that merges them with the text beside them would differ). The
    ImageInput covers the soft tokens only, every image resized to the tower's square."""

    def __init__(self, processor, boi_token_id: int, image_token_id: int, eoi_token_id: int,
                 tokens_per_image: int, blank_lines: list[int]):
        super().__init__(processor, image_token_id, 1)
        self.boi, self.eoi, self.tokens_per_image = boi_token_id, eoi_token_id, tokens_per_image
        self.blank_lines = blank_lines

    @classmethod
    def for_gemma3(cls, path: Path, config) -> Gemma3ImagePrompts:
        # deferred: transformers (and so torch) only for a vision-language model
        from transformers import Gemma3ImageProcessorPil
        blank_lines = load_tokenizer(path).encode("\n\n", add_special_tokens=False)
        ids = [_token_id(config, name) for name in ("boi", "image", "eoi")]
        return cls(Gemma3ImageProcessorPil.from_pretrained(str(path)), *ids, int(config.mm_tokens_per_image),
                   list(blank_lines))

    @property
    def placeholder(self) -> int:
        return self.boi

    def _place(self, picture, out: list[int]) -> ImageInput:
        out.extend([*self.blank_lines, self.boi])
        pixels = self.processor(images=[picture.convert("RGB")], return_tensors="np")["pixel_values"]
        image = make_image_input(pixels, len(out), self.tokens_per_image)
        out.extend([self.image_token_id] * self.tokens_per_image + [self.eoi, *self.blank_lines])
        return image


def _token_id(config, name: str) -> int:
    """config.json names Gemma 3's token ids *_token_index; transformers' config also *_token_id."""
    value = getattr(config, f"{name}_token_index", None)
    return int(value if value is not None else getattr(config, f"{name}_token_id"))
