"""Bidirectional attention over each image's tokens (Gemma 3, see pdserve.models.image_masks):
a step's per-query key ends, which the prefill kernel takes (torch_ops.prefill_attention's
key_ends). A query at position p normally sees keys below p + 1; a query inside an image whose
tokens are [a, b) sees keys below b. The scheduler keeps each such image within one prefill
chunk (and prefix-cache hits off its inside), so keys up to b - 1 are always in the step's
context.
"""
from __future__ import annotations

import numpy as np

from pdserve.engine.multimodal import step_image_spans
from pdserve.engine.request import Request


def image_key_ends(items: list[tuple[Request, int]], positions: np.ndarray, num_decodes: int) -> np.ndarray | None:
    """[prefill tokens] int64 key ends of the step's prefill rows (the rows from num_decodes on;
    items and positions [T] in row order), or None when no query of the step is an image token
    (then the kernel stays causal)."""
    ends = positions + 1
    touched = False
    for image, row, lo, hi in step_image_spans(items):
        ends[row:row + hi - lo] = image.end
        touched = True
    return ends[num_decodes:] if touched else None
