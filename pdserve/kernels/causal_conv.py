"""The short depthwise causal convolution in front of linear-attention and Mamba2 layers,
continuing from a request's window of its last kernel-1 inputs (kept in its state slot), so a
prompt split across steps convolves as if it came whole. A new request's window is zeros: the
reference's left padding."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A depthwise causal convolution over one request's span, continuing from its window of
    earlier inputs: x [T, C], window [C, K-1], weight [C, K]. Returns the output [T, C] (no
    activation) and the new window (the last K-1 inputs)."""
    full = torch.cat([window.to(x.dtype), x.transpose(0, 1)], dim=-1)
    out = F.conv1d(full[None], weight[:, None, :], bias, groups=weight.shape[0])[0]
    return out.transpose(0, 1), full[:, full.shape[1] - window.shape[1]:]


def causal_conv_step(x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token each of B requests: x [B, C], windows [B, C, K-1]. Returns [B, C] and the new
    windows."""
    full = torch.cat([windows.to(x.dtype), x[:, :, None]], dim=-1)
    out = (full * weight).sum(dim=-1)
    if bias is not None:
        out = out + bias
    return out, full[:, :, 1:]
