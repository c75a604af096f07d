"""MXFP4 experts as gpt-oss ships them (`quantization_config: {quant_method: mxfp4}`): each
expert projection P is `P_blocks` (uint8 [E, rows, cols / 32, 16]: 32 FP4 e2m1 values per
group, two per byte, the low nibble first) and `P_scales` (uint8 [E, rows, cols / 32]: the
group's power of two, biased by 127). w[e, r, c] = fp4(value) * 2^(scale - 127): exact in float32.

pdserve has no MXFP4 kernel yet: the experts are dequantized to float32 at load, into the
layout of the unquantized checkpoint ([E, cols, rows], transposed as transformers does), with
one log line counting them. The attention and the router are not quantized in these checkpoints.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

log = logging.getLogger("pdserve.quant")

FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def check_config(quantization: dict) -> None:
    if quantization.get("quant_method") != "mxfp4":
        raise ValueError(f"quant_method {quantization.get('quant_method')!r} is not supported for gpt-oss; "
                         f"supported: mxfp4 (the experts as gpt-oss ships them)")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [E, rows, groups, 16], scales uint8 [E, rows, groups] -> float32 [E, cols, rows]."""
    values = torch.stack([FP4_VALUES[(blocks & 0x0F).long()], FP4_VALUES[(blocks >> 4).long()]], dim=-1)
    values = values.reshape(*blocks.shape[:-1], 32)
    w = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return w.reshape(*blocks.shape[:2], -1).transpose(1, 2).contiguous()


def mxfp4_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each `P_blocks` / `P_scales` pair replaced by float32 `P`."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    count = 0
    for name, tensor in tensors:
        base, _, part = name.rpartition("_")
        if part not in ("blocks", "scales"):
            yield name, tensor
            continue
        parts = pending.setdefault(base, {})
        parts[part] = tensor
        if len(parts) == 2:
            del pending[base]
            count += 1
            yield base, dequantize(parts["blocks"], parts["scales"])
    if pending:
        raise ValueError(f"MXFP4 checkpoint: blocks without scales, or the reverse: {', '.join(sorted(pending)[:8])}")
    if count:
        log.warning("MXFP4 checkpoint: %d expert tensors have no MXFP4 kernel in pdserve and were dequantized "
                    "to float at load", count)
