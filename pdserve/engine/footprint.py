"""What a node holds in memory: its weights' bytes (as stored: a quantized layer counts its
packed weights and scales, a tied LM head counts once), its KV cache's bytes per token, and the
process's resident memory; and the longest request its engine takes (max_model_len). Nodes log
them at start and report them in their pongs, which the router exports in /metrics (and checks
prompts against max_model_len)."""
from __future__ import annotations

import os

from torch import nn


def weight_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() in seen or tensor.device.type == "meta":
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def resident_bytes() -> int:
    """The process's resident set now (Linux /proc); 0 where that cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def footprint(engine) -> dict[str, int]:
    # Weights and the KV layout do not change while a node runs: measured once per engine (a
    # pong asks for them several times a second).
    fixed = getattr(engine, "_fixed_footprint", None)
    if fixed is None:
        # max_model_len: the longest request the engine takes; the router refuses a longer
        # prompt itself, before a stream's 200 goes out
        fixed = engine._fixed_footprint = {"weight_bytes": weight_bytes(engine.model),
                                           "kv_bytes_per_token": engine.kv_layout.block_nbytes(1),
                                           "max_model_len": engine.max_model_len}
    return {**fixed, "resident_bytes": resident_bytes()}
