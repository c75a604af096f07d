"""Images in the engine's steps: each image is encoded once (the encoder cache keeps its
embeddings by content hash), and a step that computes some of its placeholder tokens takes
the rows it needs from the embeddings, so chunked prefill may cut through an image without
encoding it again. A multimodal-RoPE model's [3, T] positions are built here too.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.request import Request
from pdserve.protocol.multimodal import ImageInput, check_image_inputs


@dataclass
class EncoderStats:
    hits: int = 0  # an image's embeddings found in the cache
    encoder_runs: int = 0  # images encoded
    encoded_tokens: int = 0  # embeddings those runs gave


class EncoderCache:
    """Image embeddings by content hash, least recently used first out, within a budget in
    embedding rows (tokens). budget 0: no cache (every step that needs an image encodes it)."""

    def __init__(self, budget_tokens: int):
        self.budget = budget_tokens
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.tokens = 0
        self.stats = EncoderStats()

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self.entries

    def get(self, image: ImageInput, encode) -> torch.Tensor:
        found = self.entries.get(image.content_hash)
        if found is not None:
            self.entries.move_to_end(image.content_hash)
            self.stats.hits += 1
            return found
        embeddings = encode(image)
        self.stats.encoder_runs += 1
        self.stats.encoded_tokens += embeddings.shape[0]
        self.put(image.content_hash, embeddings)
        return embeddings

    def put(self, content_hash: str, embeddings: torch.Tensor) -> None:
        if embeddings.shape[0] > self.budget or content_hash in self.entries:
            return
        while self.tokens + embeddings.shape[0] > self.budget:
            _, old = self.entries.popitem(last=False)
            self.tokens -= old.shape[0]
        self.entries[content_hash] = embeddings
        self.tokens += embeddings.shape[0]


@dataclass
class ImageRows:
    """A step's rows that hold image placeholders, and their embeddings."""
    rows: torch.Tensor  # [R] int64
    values: torch.Tensor  # [R, hidden]

    def merge(self, embedded: torch.Tensor) -> torch.Tensor:
        return embedded.index_copy(0, self.rows, self.values.to(embedded.dtype))


def step_image_spans(items: list[tuple[Request, int]]) -> Iterator[tuple[ImageInput, int, int, int]]:
    """(image, first row, lo, hi) for each image a step computes tokens [lo, hi) of; items in
    row order, (request, tokens computed from num_computed_tokens); rows first row.. hold them."""
    row0 = 0
    for req, n in items:
        start = req.num_computed_tokens
        for image in req.images:
            lo, hi = max(start, image.offset), min(start + n, image.end)
            if lo < hi:
                yield image, row0 + lo - start, lo, hi
        row0 += n


class MultiModalInputs:
    """What a multimodal model's step takes beside token ids: image rows and [3, T] positions."""

    def __init__(self, model, cache: EncoderCache):
        self.model, self.cache = model, cache

    def image_rows(self, items: list[tuple[Request, int]], device: torch.device) -> ImageRows | None:
        """items in row order: (request, tokens this step computes from num_computed_tokens)."""
        rows, values = [], []
        for image, row, lo, hi in step_image_spans(items):
            embeddings = self.cache.get(image, self.model.encode_image)
            rows.append(torch.arange(row, row + hi - lo))
            values.append(embeddings[lo - image.offset:hi - image.offset])
        if not rows:
            return None
        return ImageRows(torch.cat(rows).to(device), torch.cat(values).to(device))

    def uncached_images(self, req: Request, start: int, end: int) -> list[ImageInput]:
        """The request's images that tokens [start, end) need and the encoder cache lacks."""
        return [im for im in req.images if im.overlaps(start, end) and im.content_hash not in self.cache]

    @staticmethod
    def positions(items: list[tuple[Request, int]], flat: np.ndarray) -> np.ndarray:
        """[3, T] positions from the step's token indices (flat [T], in row order): a prompt
        token's own M-RoPE position, every later token its index plus the request's delta."""
        out = np.broadcast_to(flat, (3, flat.shape[0])).copy()
        row0 = 0
        for req, n in items:
            if req.mrope is not None:
                prompt, delta = req.mrope
                start, P = req.num_computed_tokens, prompt.shape[1]
                cut = min(max(P - start, 0), n)  # this step's tokens that are prompt tokens
                out[:, row0:row0 + cut] = prompt[:, start:start + cut]
                out[:, row0 + cut:row0 + n] += delta
            row0 += n
        return out

    def prepare(self, req: Request) -> None:
        """Checks the request's images against its placeholders, and sets its M-RoPE positions
        (numpy, host side) once, at admission (a model without M-RoPE keeps plain positions)."""
        prompt, token = req.prompt_token_ids, self.model.image_token_id
        check_image_inputs(req.images, prompt)
        if any(prompt[i] != token for im in req.images for i in range(im.offset, im.end)):
            raise ValueError(f"an image's placeholder range holds tokens other than the image token {token}")
        if prompt.count(token) != sum(im.length for im in req.images):
            raise ValueError("the prompt has image placeholder tokens that no image fills")
        if not getattr(self.model, "uses_mrope", True):
            return
        positions, delta = self.model.prompt_positions(req.prompt_token_ids, req.images)
        req.mrope = (positions.numpy(), delta)
