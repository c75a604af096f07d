"""Nemotron-H's MoE block: DeepSeek-V3's routing (sigmoid scores, a correction bias that picks
experts without weighting them, grouped top-k, renormalised, scaled), experts that are plain
up/down MLPs with a squared ReLU (no gate), and a shared expert of the same kind.

The experts run through pdserve.models.moe.Experts (one grouped matmul per projection), whose
first projection here is the up projection alone: [E, I, H] instead of gate and up [E, 2I, H].
`checkpoint_target` maps the checkpoint's per-expert tensors into those stacks.
"""
from __future__ import annotations

import functools
import re

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models.moe import Experts, grouped_topk

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")


def squared_relu(h: torch.Tensor) -> torch.Tensor:
    return F.relu(h).square()


class UngatedExperts(Experts):
    """E experts down(relu(up(x))^2): gate_up_proj holds the up projections alone, [E, I, H]."""

    gated = False

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        nn.Module.__init__(self)
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.gate_up_bias = self.down_bias = None
        self.activation = squared_relu


class NemotronHMoE(nn.Module):
    def __init__(self, config, shared_mlp: nn.Module):
        super().__init__()
        experts = config.n_routed_experts
        self.gate = nn.Linear(config.hidden_size, experts, bias=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts))
        self.experts = UngatedExperts(experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = shared_mlp
        self.route = functools.partial(grouped_topk, top_k=config.num_experts_per_tok, scoring="sigmoid",
                                       n_group=config.n_group, topk_group=config.topk_group, group_score="top2_sum",
                                       renormalize=config.norm_topk_prob, scaling=config.routed_scaling_factor)

    def forward(self, x: torch.Tensor, cos=None, sin=None, ctx=None) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight.float())  # the router runs in float32
        weights, ids = self.route(logits, self.e_score_correction_bias)
        return self.experts(x, ids, weights) + self.shared_experts(x)


def checkpoint_target(name: str) -> tuple[str, tuple]:
    """(parameter, index) a MoE block's checkpoint tensor goes to: one expert's up or down
    projection into its slot of the stack, the routing bias out of the router (a buffer there)."""
    expert = _EXPERT.match(name)
    if expert:
        base, e, part = expert.groups()
        return f"{base}.{'gate_up_proj' if part == 'up_proj' else 'down_proj'}", (int(e),)
    return name.replace(".gate.e_score_correction_bias", ".e_score_correction_bias"), ()
