"""Gemma 3's attention rule over a prompt with images, as pure functions.

Gemma 3's language model is causal except over each image's placeholder tokens: token i may
attend to token j when j <= i, or when i and j are tokens of the same image (in both
directions). On its sliding-window layers that is further cut to j > i - sliding_window (only a
lower bound, so an image token still sees the later tokens of its image).

transformers 5.24 builds it from `token_type_ids` (1 on image placeholder tokens, which the
Gemma 3 processor emits as `mm_token_type_ids` and renames): get_block_sequence_ids_for_mask
numbers each maximal run of image tokens (-1 elsewhere), and create_masks_for_vision_model
ORs the causal mask with "same run, not -1" (blockwise_overlay) and, for sliding layers, ANDs
sliding_window_overlay on top. The image's <start_of_image> and <end_of_image> tokens are text
(type 0) and stay causal. Two images with no token between them would form one run, and so one
bidirectional block, in transformers as here; the Gemma 3 processor always puts
<end_of_image>, blank lines and <start_of_image> between them.

A prefill chunk is rows [query_start, len) of the whole prompt's mask, with keys [0, len): the
block ids must cover the sequence from its start (as generate passes them). A chunk that ends
inside an image cannot see that image's later tokens, which are not computed yet, so it is not
exact: the engine must not cut a Gemma 3 image across chunks. Decode tokens are text and
plain causal (or sliding).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def image_block_ids(input_ids: Sequence[int] | torch.Tensor, image_token_id: int) -> torch.Tensor:
    """[len] long: for each token, the number of the run of image placeholder tokens it is in
    (0 for the first image, 1 for the second, ...), -1 for every other token."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    is_image = ids == image_token_id
    starts = is_image & ~torch.cat([torch.zeros(1, dtype=torch.bool), is_image[:-1]])
    return torch.where(is_image, starts.long().cumsum(0) - 1, torch.full_like(ids, -1))


def gemma3_attention_mask(block_ids: torch.Tensor, sliding_window: int | None = None,
                          query_start: int = 0) -> torch.Tensor:
    """[len - query_start, len] bool, True where the query at position query_start + r may
    attend to the key at position c: c <= query, or both in the same image block; with a
    sliding_window, only where c > query - sliding_window as well."""
    block_ids = torch.as_tensor(block_ids, dtype=torch.long).reshape(-1)
    n = block_ids.numel()
    if not 0 <= query_start <= n:
        raise ValueError(f"query_start {query_start} is outside the sequence of {n} tokens")
    q = torch.arange(query_start, n, device=block_ids.device)[:, None]
    k = torch.arange(n, device=block_ids.device)[None, :]
    q_block, k_block = block_ids[q], block_ids[k]
    allowed = (k <= q) | ((q_block == k_block) & (q_block >= 0))
    if sliding_window is not None:
        allowed &= k > q - sliding_window
    return allowed


def gemma3_layer_masks(block_ids: torch.Tensor, sliding_window: int,
                       query_start: int = 0) -> dict[str, torch.Tensor]:
    """The mask of each Gemma 3 layer type ("full_attention", "sliding_attention")."""
    return {"full_attention": gemma3_attention_mask(block_ids, None, query_start),
            "sliding_attention": gemma3_attention_mask(block_ids, sliding_window, query_start)}
