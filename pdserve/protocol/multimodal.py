"""A prompt's images as every layer sees them: where their placeholder tokens sit, the content
hash that keys their KV apart, and the preprocessed pixels a vision tower encodes.

The router (or the offline API) runs the model's own transformers image processor, expands each
image's placeholder into as many tokens as the tower gives embeddings, and sends this with the
prompt. Nodes never decode an image file. The hash is taken over the preprocessed pixels and
their shape, so it is the same in every process that runs the same processor on the same image
(and the model name in the layout salt keeps two models' KV apart anyway).
"""
from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import xxhash


class ImageInput(msgspec.Struct, frozen=True):
    """One image of a prompt: its placeholder tokens are prompt_token_ids[offset:offset+length]."""
    content_hash: str  # hex xxh3-128 of the pixels (image_hash)
    offset: int
    length: int
    pixel_values: bytes  # float32, little-endian, row-major, of shape pixel_shape
    pixel_shape: list[int]
    grid_thw: list[int] | None = None  # Qwen2.5-VL: the patch grid (t, h, w)

    @property
    def end(self) -> int:
        """One past the image's last placeholder token."""
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Some of the image's tokens lie in prompt positions [start, end)."""
        return self.offset < end and self.end > start

    @property
    def key(self) -> bytes:
        """The 16 bytes that enter the block keys of the blocks holding this image's tokens."""
        return bytes.fromhex(self.content_hash)

    def pixels(self) -> np.ndarray:
        return np.frombuffer(self.pixel_values, dtype="<f4").reshape(self.pixel_shape)


def image_hash(pixels: np.ndarray, grid_thw: Sequence[int] | None = None) -> str:
    """xxh3-128 over the preprocessed pixels, their shape and grid: one image, one hash."""
    h = xxhash.xxh3_128()
    h.update(f"{list(pixels.shape)}|{list(grid_thw or [])}|".encode())
    h.update(np.ascontiguousarray(pixels, dtype="<f4").tobytes())
    return h.hexdigest()


def make_image_input(pixels: np.ndarray, offset: int, length: int,
                     grid_thw: Sequence[int] | None = None) -> ImageInput:
    pixels = np.ascontiguousarray(pixels, dtype="<f4")
    grid = [int(v) for v in grid_thw] if grid_thw is not None else None
    return ImageInput(image_hash(pixels, grid), offset, length, pixels.tobytes(), list(pixels.shape), grid)


def check_image_inputs(images: Sequence[ImageInput], prompt_token_ids: Sequence[int]) -> None:
    """ValueError unless the images' placeholder ranges are in order, disjoint and inside the
    prompt, with well-formed pixels."""
    end = 0
    for i, image in enumerate(images):
        if image.length <= 0 or image.offset < end or image.end > len(prompt_token_ids):
            raise ValueError(f"image {i}'s placeholder range [{image.offset}, {image.end}) "
                             f"is out of order or outside the prompt ({len(prompt_token_ids)} tokens)")
        if len(image.content_hash) != 32:
            raise ValueError(f"image {i}'s content_hash must be 32 hex digits")
        if len(image.pixel_values) != 4 * int(np.prod(image.pixel_shape)):
            raise ValueError(f"image {i}'s pixel_values do not hold a float32 array of shape {image.pixel_shape}")
        end = image.end


def block_extra(images: Sequence[ImageInput], start: int, end: int) -> bytes:
    """The keys of the images whose tokens overlap prompt positions [start, end), in order:
    what a block covering those positions adds to its key (block_keys.block_key's extra)."""
    return b"".join(im.key for im in images if im.overlaps(start, end))
