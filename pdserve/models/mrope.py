"""M-RoPE (multimodal rotary positions) for Qwen2.5-VL's language model.

Every token has three positions (temporal, height, width). A text token has the same value on
all three, counting on from the token before it. An image's placeholder tokens (one per merged
2x2 patch group) take t on the temporal axis and their row and column in the merged grid on the
other two, each offset by the position the image starts at. The text after an image resumes at
start + max(rows, columns), which for an image (t = 1) is the image's largest position + 1, so
a prompt's last position is usually smaller than its length. Once the prompt is known, every
later token's position is its index plus a fixed delta (max position + 1 - prompt length) on
all three axes: a decode node needs only that delta, not the image.

The head's rotary frequencies are split into three sections (mrope_section, summing to
head_dim / 2): section i rotates by axis i's position. transformers 5.24 does the split in
Qwen2_5_VLRotaryEmbedding.recomposition_frequencies and then applies the plain rotate-half
RoPE; so does this module.

Images only: videos (whose temporal positions are spaced by tokens_per_second and the frame
interval) are not implemented.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.models.rope import RotaryEmbedding
from pdserve.protocol.multimodal import ImageInput


def image_spans(input_ids: Sequence[int], image_token_id: int, tokens_per_image: Sequence[int]) -> list[tuple[int, int]]:
    """(start, length) of each image's placeholder tokens, in prompt order. Placeholders are
    assigned to images in order; a run of placeholders may hold several images back to back."""
    spans, i, n = [], 0, len(input_ids)
    for count in tokens_per_image:
        while i < n and input_ids[i] != image_token_id:
            i += 1
        if i + count > n or any(t != image_token_id for t in input_ids[i:i + count]):
            raise ValueError(f"the prompt has fewer image placeholder tokens than its images need "
                             f"(image {len(spans)} needs {count} at position {i})")
        spans.append((i, count))
        i += count
    if image_token_id in input_ids[i:]:
        raise ValueError("the prompt has more image placeholder tokens than its images need")
    return spans


def _image_positions(start: int, grid_thw: Sequence[int], merge: int) -> torch.Tensor:
    """[3, t*h*w/merge^2]: the image's (t, row, column) in the merged grid, offset by start."""
    t, h, w = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_positions(input_ids: Sequence[int], image_token_id: int, image_grid_thw: torch.Tensor | None,
                    spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """([3, len(input_ids)] positions, delta) of a prompt, as transformers' get_rope_index gives
    them for one unpadded sequence with images; delta is what decode_positions adds to the
    indices of the tokens after the prompt."""
    input_ids = list(input_ids)
    grids = [] if image_grid_thw is None else [tuple(int(v) for v in g) for g in image_grid_thw.tolist()]
    merge = spatial_merge_size
    spans = image_spans(input_ids, image_token_id, [t * h * w // merge ** 2 for t, h, w in grids])
    pieces, pos, cursor = [], 0, 0
    for (start, length), grid in zip(spans, grids):
        text = start - cursor
        pieces.append(torch.arange(text).expand(3, -1) + pos)
        pos += text
        pieces.append(_image_positions(pos, grid, merge))
        # transformers' step: max(h, w) merged units, the image's largest position + 1 when t = 1
        pos += max(grid[1], grid[2]) // merge
        cursor = start + length
    pieces.append(torch.arange(len(input_ids) - cursor).expand(3, -1) + pos)
    positions = torch.cat(pieces, dim=1)
    delta = int(positions.max()) + 1 - len(input_ids) if input_ids else 0
    return positions, delta


def decode_positions(first_index: int, count: int, delta: int) -> torch.Tensor:
    """[3, count] positions of the tokens at indices first_index.. after a prompt whose
    mrope_positions gave delta: the same value on all three axes."""
    return (torch.arange(first_index, first_index + count) + delta).expand(3, -1)


class MRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding whose cos/sin take [3, T] positions: column j of the head rotates by the
    position on the axis whose mrope_section holds j (mod head_dim / 2)."""

    def __init__(self, hf_text_config, head_dim: int, max_positions: int):
        super().__init__(hf_text_config, head_dim, max_positions)
        params = getattr(hf_text_config, "rope_parameters", None) or getattr(hf_text_config, "rope_scaling", None) or {}
        section = list(params.get("mrope_section") or [])
        if len(section) != 3 or sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {section} must have 3 parts summing to head_dim/2 = {head_dim // 2}")
        axis = torch.cat([torch.full((n,), i) for i, n in enumerate(section)])
        self._axis = torch.cat([axis, axis])  # the rotate-half layout repeats the frequencies

    def to(self, device: torch.device) -> MRotaryEmbedding:
        super().to(device)
        self._axis = self._axis.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] -> cos, sin [T, 1, head_dim], for RotaryEmbedding.apply."""
        # an image's tokens never take more positions than their count, so max_positions
        # (max_position_embeddings) bounds every prompt that fits the model
        if int(positions.max()) >= self._table[0].shape[0]:
            raise ValueError(f"M-RoPE position {int(positions.max())} is beyond the table ({self._table[0].shape[0]})")
        tokens = torch.arange(positions.shape[1], device=positions.device)[:, None]
        cols = torch.arange(self._axis.shape[0], device=positions.device)[None, :]
        out = []
        for table in self._table:
            per_axis = table[positions]  # [3, T, head_dim]
            out.append(per_axis[self._axis[None, :], tokens, cols].to(dtype)[:, None, :])
        return out[0], out[1]


class MRopeImages:
    """What Qwen's vision-language models (Qwen2.5-VL, Qwen3.5) do with an image, over their own
    tower (`visual`), placeholder id (`image_token_id`) and merge size (`spatial_merge_size`): its
    embeddings, one per placeholder, and the prompt's [3, P] M-RoPE positions."""

    visual: torch.nn.Module
    image_token_id: int
    spatial_merge_size: int

    def encode_image(self, image: ImageInput) -> torch.Tensor:
        """[image.length, hidden]: the image's embeddings, one per placeholder token."""
        weight = self.visual.patch_embed.proj.weight
        pixels = torch.tensor(image.pixels(), dtype=weight.dtype, device=weight.device)  # a copy: the bytes are read-only
        out = self.visual(pixels, torch.tensor([image.grid_thw]))
        if out.shape[0] != image.length:
            raise ValueError(f"the image's grid {image.grid_thw} gives {out.shape[0]} embeddings for "
                             f"{image.length} placeholder tokens")
        return out

    def prompt_positions(self, prompt_token_ids: Sequence[int], images: Sequence[ImageInput]
                         ) -> tuple[torch.Tensor, int]:
        """([3, P] M-RoPE positions of the prompt, delta of every later token)."""
        grids = torch.tensor([im.grid_thw for im in images]) if images else None
        return mrope_positions(prompt_token_ids, self.image_token_id, grids, self.spatial_merge_size)
