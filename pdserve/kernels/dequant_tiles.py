"""The matmul of every quantized CPU kernel above its gemv's token count: dequantize a tile of
weight rows into a reused float32 buffer (about 1 MB, so it stays in cache) and multiply it with
BLAS. Each kernel passes the function that fills a tile from its own format."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

TILE_BYTES = 1 << 20
_tiles: dict[int, np.ndarray] = {}  # columns -> the reused tile buffer


def matmul_by_tiles(x: torch.Tensor, rows: int, fill_tile: Callable[[int, int, np.ndarray], None],
                 min_rows: int = 16) -> torch.Tensor:
    """x [tokens, K] float32 @ w.T -> [tokens, rows]; fill_tile(start, end, tile) writes rows
    start..end of w, dequantized, into tile [end - start, K]."""
    cols = x.shape[1]
    tile_rows = max(min_rows, TILE_BYTES // (4 * cols))
    buffer = _tiles.get(cols)
    if buffer is None or buffer.shape[0] < tile_rows:
        buffer = _tiles[cols] = np.empty((tile_rows, cols), dtype=np.float32)
    out_t = torch.empty(rows, x.shape[0])  # [N, tokens]: each tile's product is a contiguous slice
    for start in range(0, rows, tile_rows):
        end = min(rows, start + tile_rows)
        tile = buffer[:end - start]
        fill_tile(start, end, tile)
        torch.mm(torch.from_numpy(tile), x.T, out=out_t[start:end])
    return out_t.T.contiguous()
