"""NIXL transfer descriptors: (addr, nbytes, dev_id) byte ranges, merged and sliced."""
from __future__ import annotations

from collections.abc import Sequence

Region = tuple[int, int, int]  # (addr, nbytes, dev_id)


def coalesce_pairs(local: Sequence[Region], remote: Sequence[Region]
                   ) -> tuple[list[Region], list[Region]]:
    """Merge neighbouring descriptor pairs that are contiguous on both sides.

    Fewer, larger descriptors mean fewer UCX operations; runs of consecutive block ids
    (common: blocks are often allocated in order) collapse into one descriptor.
    """
    out_l: list[Region] = []
    out_r: list[Region] = []
    for (la, ln, ld), (ra, rn, rd) in zip(local, remote):
        if out_l:
            pla, pln, pld = out_l[-1]
            pra, prn, prd = out_r[-1]
            if pla + pln == la and pra + prn == ra and pld == ld and prd == rd:
                out_l[-1] = (pla, pln + ln, pld)
                out_r[-1] = (pra, prn + rn, prd)
                continue
        out_l.append((la, ln, ld))
        out_r.append((ra, rn, rd))
    return out_l, out_r


def layer_slices(regions: Sequence[Region], start: int, end: int, num_layers: int) -> list[Region]:
    """Layers [start, end) of each whole block region."""
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"layers [{start}, {end}) of {num_layers}")
    return [(addr + start * (n // num_layers), (end - start) * (n // num_layers), dev) for addr, n, dev in regions]
