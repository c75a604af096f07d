"""The short causal convolution of the stateful layers (Gated DeltaNet, Mamba2) over the step's
rows, continuing each request's window in its state slot (updated in place).

A tensor-parallel rank convolves only its channels, which are runs of the pool's whole window
(the pool keeps every head at any degree, like the KV cache: pdserve.models.tp_shard_hybrid).
The convolution is per channel, so each run is convolved on its own, against its view of the
window."""
from __future__ import annotations

import torch

from pdserve.kernels import causal_conv, recurrent_cpu


def convolve_runs(x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  runs: list[tuple[int, int]], states) -> torch.Tensor:
    """x [T, C] in the step's row order (ctx.states: StateRows); windows the pool's [slots, C_all,
    K-1] view; runs: (first channel in the window, count) of x's columns, in order."""
    if len(runs) == 1 and runs[0] == (0, windows.shape[1]):
        return convolve(x, windows, weight, bias, states)
    pieces, at = [], 0
    for first, count in runs:
        part = slice(at, at + count)
        pieces.append(convolve(x[:, part].contiguous(), windows.narrow(1, first, count), weight[part],
                               None if bias is None else bias[part], states))
        at += count
    return torch.cat(pieces, dim=-1)


def convolve(x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             states) -> torch.Tensor:
    """The one-token queries batched (compiled where the windows allow), then each prefill chunk
    (all of them in one compiled call where the windows allow)."""
    pieces, d, compiled = [], states.num_decodes, recurrent_cpu.usable(windows)
    out = recurrent_cpu.conv_spans(x, windows, states.spans, weight, bias) if compiled and states.spans else None
    if out is not None:
        if d:
            out[:d] = recurrent_cpu.conv_step(x[:d], windows, states.slots, weight, bias)
        return out
    if d and compiled:  # compiled, the windows updated in place
        pieces.append(recurrent_cpu.conv_step(x[:d], windows, states.slots, weight, bias))
    elif d:
        out, windows[states.slots] = causal_conv.causal_conv_step(x[:d], windows[states.slots], weight, bias)
        pieces.append(out)
    for slot, start, end in states.spans:
        out, windows[slot] = causal_conv.causal_conv(x[start:end], windows[slot], weight, bias)
        pieces.append(out)
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]
