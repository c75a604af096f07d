"""MXFP4 experts as gpt-oss ships them (`quantization_config: {quant_method: mxfp4}`): each
expert projection P is `P_blocks` (uint8 [E, rows, cols / 32, 16]: 32 FP4 e2m1 values per
group, two per byte, the low nibble first) and `P_scales` (uint8 [E, rows, cols / 32]: the
group's power of two, biased by 127). w[e, r, c] = fp4(value) * 2^(scale - 127): exact in float32.

They stay packed (pdserve.models.moe_quant.Mxfp4Experts, pdserve.kernels.mxfp4_cpu): the blocks
are held as [E, rows, cols / 2] bytes, gate_up's rows reordered from gpt-oss's interleaved
gate/up to gate rows first, as the float checkpoints are loaded. The attention and the router
are not quantized in these checkpoints.
"""
from __future__ import annotations

import torch


def check_config(quantization: dict) -> None:
    if quantization.get("quant_method") != "mxfp4":
        raise ValueError(f"quant_method {quantization.get('quant_method')!r} is not supported for gpt-oss; "
                         f"supported: mxfp4 (the experts as gpt-oss ships them)")


def packed_expert_part(part: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """A checkpoint's `gate_up_proj_blocks` (etc.) -> (Mxfp4Experts parameter, its value); None
    for a part that is not MXFP4."""
    proj, _, kind = part.rpartition("_")
    if kind not in ("blocks", "scales") or proj not in ("gate_up_proj", "down_proj"):
        return None
    if proj == "gate_up_proj":  # rows interleave gate and up: gate rows first
        tensor = torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
    if kind == "blocks":
        return proj, tensor.reshape(*tensor.shape[:2], -1).contiguous()
    return f"{proj.removesuffix('_proj')}_scale", tensor.contiguous()
