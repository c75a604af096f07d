"""Mixture-of-experts pieces shared by the MoE families (Qwen2/3-MoE, Mixtral, gpt-oss, DeepSeek).

A MoE layer is a router (logits -> top-k expert ids and weights per token) plus E expert MLPs
whose outputs are summed with those weights, sometimes plus a shared expert. The routers differ
per family; the experts are the same batched computation:

- ``softmax_topk``: softmax over all experts, top-k, optional renormalisation (Qwen, Mixtral).
- ``topk_softmax``: top-k logits, then softmax over those k (gpt-oss).
- ``grouped_topk``: DeepSeek. V3: ``scoring="sigmoid"``, ``correction_bias`` =
  ``e_score_correction_bias`` (used to choose experts, not to weight them), ``group_score="top2_sum"``,
  ``renormalize=norm_topk_prob``, ``scaling=routed_scaling_factor``, ``n_group``/``topk_group``.
  V2: ``scoring="softmax"``, ``group_score="max"`` for ``topk_method="group_limited_greedy"``
  (``n_group=1, topk_group=1`` for ``"greedy"``), ``renormalize=False`` (as transformers does).
- ``Experts``: E SwiGLU experts stacked as ``gate_up_proj [E, 2I, H]`` (gate rows first) and
  ``down_proj [E, H, I]``, optional biases, a pluggable activation. ``forward(x, ids, weights)``.
- ``DenseMLP``: one SwiGLU MLP (a shared expert, or a dense layer beside MoE layers).
- ``SparseMoE``: router weight ``gate`` + ``Experts`` + optional shared expert (and Qwen2-MoE's
  sigmoid ``shared_expert_gate``), given a routing function.

DeepSeek's MoE, for example::

    route = functools.partial(grouped_topk, top_k=cfg.num_experts_per_tok, scoring="sigmoid",
                              n_group=cfg.n_group, topk_group=cfg.topk_group,
                              group_score="top2_sum", renormalize=cfg.norm_topk_prob,
                              scaling=cfg.routed_scaling_factor)
    moe = SparseMoE(hidden, cfg.moe_intermediate_size, cfg.n_routed_experts, route,
                    shared_intermediate=cfg.moe_intermediate_size * cfg.n_shared_experts,
                    correction_bias=True)

and load ``...mlp.gate.e_score_correction_bias`` into ``moe.e_score_correction_bias`` and each
expert's gate/up/down rows with ``Experts.load_expert``.

Tokens are grouped by expert with one stable sort: the experts' matmuls run as one grouped
matmul per projection over all their tokens (torch._grouped_mm; with a few rows per expert, as
at decode, the compiled kernel in pdserve.kernels.numba_moe, about twice as fast there; a loop
over experts where neither exists, never a loop over tokens), and the weighted outputs are scattered back with one
index_add. On CUDA with Triton, ``Experts`` runs as two grouped GEMMs instead
(pdserve.kernels.triton_moe), with no host synchronisation, so MoE decode steps can be captured
in CUDA graphs (``experts_graph_safe``).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.quant.unquantized import float_swiglu_bf16

# (logits [T, E] in float32, correction bias [E] or None) -> (weights [T, K] float32, ids [T, K])
RouteFn = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


def softmax_topk(logits: torch.Tensor, bias: torch.Tensor | None = None, *, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, then the top k (renormalised to sum 1 if asked)."""
    probs = logits.float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def topk_softmax(logits: torch.Tensor, bias: torch.Tensor | None = None, *,
                 top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k logits, then a softmax over just those (gpt-oss)."""
    values, ids = logits.topk(top_k, dim=-1)
    return values.softmax(dim=-1), ids


def grouped_topk(logits: torch.Tensor, bias: torch.Tensor | None = None, *, top_k: int,
                 scoring: str = "sigmoid", n_group: int = 1, topk_group: int = 1,
                 group_score: str = "top2_sum", renormalize: bool = True,
                 scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek routing: score every expert (sigmoid or softmax, float32), keep the experts of
    the topk_group best of n_group groups, choose top_k of those by score + bias, weight them by
    the unbiased score (renormalised if asked) times the routed scaling factor."""
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring {scoring!r} is not supported; supported: sigmoid, softmax")
    scores = logits.float().sigmoid() if scoring == "sigmoid" else logits.float().softmax(dim=-1)
    choice = scores if bias is None else scores + bias.float()
    tokens, experts = choice.shape
    if n_group > 1:
        grouped = choice.view(tokens, n_group, experts // n_group)
        if group_score == "top2_sum":
            per_group = grouped.topk(2, dim=-1).values.sum(dim=-1)
        elif group_score == "max":
            per_group = grouped.max(dim=-1).values
        else:
            raise ValueError(f"group_score {group_score!r} is not supported; supported: top2_sum, max")
        keep_groups = per_group.topk(topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(per_group, dtype=torch.bool).scatter_(1, keep_groups, True)
        expert_mask = group_mask.repeat_interleave(experts // n_group, dim=1)
        # As transformers: dropped groups' softmax scores become 0 (V2), sigmoid ones -inf (V3).
        choice = choice.masked_fill(~expert_mask, float("-inf") if scoring == "sigmoid" else 0.0)
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


@functools.cache
def _numba_moe():
    try:
        from pdserve.kernels import numba_moe  # deferred: numba (~0.1 s), for CPU decode steps only; None without it
    except ImportError:
        return None
    return numba_moe


def _torch_grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(rows, weight.transpose(1, 2), offs=offs)


@functools.cache
def _triton_moe():
    try:
        from pdserve.kernels import triton_moe  # optional dependency: triton (the pdserve[triton] extra)
    except ImportError:
        return None
    return triton_moe


def experts_graph_safe() -> bool:
    """Whether Experts on CUDA avoids host synchronisation (the Triton path), so a model's
    decode step can be captured in a CUDA graph."""
    return _triton_moe() is not None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up = [gate | up] along the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts' gate: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class Experts(nn.Module):
    """E expert MLPs, stacked: gate_up_proj [E, 2I, H], down_proj [E, H, I] (+ biases)."""

    gated = True  # the fused CUDA experts (triton_moe) compute gated MLPs only

    def __init__(self, num_experts: int, hidden: int, intermediate: int, bias: bool = False,
                 activation: Callable[[torch.Tensor], torch.Tensor] = silu_mul):
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate)) if bias else None
        self.down_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        self.activation = activation

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; ids, weights [T, K]: each token's experts and their weights -> [T, H]."""
        if x.is_cuda and self.gated and _triton_moe() is not None:
            return _triton_moe().fused_experts(x, ids, weights, self.gate_up_proj, self.down_proj,
                                               self.activation, self.gate_up_bias, self.down_bias)
        tokens, top_k = ids.shape
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        token_of = order // top_k
        rows = x[token_of]
        counts = torch.bincount(flat, minlength=self.num_experts)
        matmul = self._cpu_grouped_matmul(x, flat.numel())
        if matmul is not None:
            out = self._grouped(rows, flat[order], counts, matmul)
        else:
            out = self._looped(rows, counts.tolist())
        # In place: at prefill sizes a second [T*K, H] temporary costs a pass of page faults.
        out.mul_(weights.reshape(-1)[order, None].to(out.dtype))
        return torch.zeros_like(x).index_add_(0, token_of, out)

    def _cpu_grouped_matmul(self, x: torch.Tensor, pairs: int):
        """The grouped matmul for this step on the CPU: the compiled small-group kernel when
        the experts get few rows each (decode), torch._grouped_mm otherwise; None: loop."""
        if x.is_cuda:
            return None
        small = _numba_moe()
        if (small is not None and x.dtype == torch.float32
                and pairs <= small.MAX_ROWS_PER_EXPERT * self.num_experts):
            return small.grouped_small_mm
        return _torch_grouped_mm if hasattr(torch, "_grouped_mm") else None

    def _grouped(self, rows: torch.Tensor, row_expert: torch.Tensor, counts: torch.Tensor,
                 matmul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """All experts in one grouped matmul per projection (one op, not one per expert: on a
        busy CPU each op's thread barrier costs more than its arithmetic)."""
        offs = counts.cumsum(0).to(torch.int32)
        h = matmul(rows, self.gate_up_proj, offs)
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[row_expert]
        out = matmul(self.activation(h), self.down_proj, offs)
        if self.down_bias is not None:
            out = out + self.down_bias[row_expert]
        return out

    def _looped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start:start + n] = self._expert(e, rows[start:start + n])
                start += n
        return out

    def _expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        b1 = self.gate_up_bias[e] if self.gate_up_bias is not None else None
        b2 = self.down_bias[e] if self.down_bias is not None else None
        return F.linear(self.activation(F.linear(h, self.gate_up_proj[e], b1)), self.down_proj[e], b2)

    def load_expert(self, e: int, part: str, tensor: torch.Tensor) -> None:
        """Copy one expert's HF weight: part is gate_proj, up_proj or down_proj ([out, in])."""
        i = self.intermediate
        target = {"gate_proj": self.gate_up_proj.data[e, :i], "up_proj": self.gate_up_proj.data[e, i:],
                  "down_proj": self.down_proj.data[e]}[part]
        if target.shape != tensor.shape:
            raise ValueError(f"expert {e} {part}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)


class DenseMLP(nn.Module):
    """One SwiGLU MLP with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False,
                 activation: Callable[[torch.Tensor], torch.Tensor] = silu_mul, linear: type[nn.Linear] = nn.Linear):
        """linear: the layers' class (the hybrids pass FloatLinear; the compiled MoE step takes nn.Linear's)."""
        super().__init__()
        self.gate_up_proj = linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = linear(intermediate, hidden, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation is silu_mul:  # a prefill's rows of FloatLinear layers under bf16 products
            y = float_swiglu_bf16(self.gate_up_proj, self.down_proj, x)
            if y is not None:
                return y
        return self.down_proj(self.activation(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    """Router + experts (+ shared expert). `gate` is the router's weight as a Linear [E, H]."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, route: RouteFn, *,
                 router_bias: bool = False, expert_bias: bool = False,
                 activation: Callable[[torch.Tensor], torch.Tensor] = silu_mul,
                 shared_intermediate: int = 0, shared_gate: bool = False,
                 correction_bias: bool = False, router_fp32: bool = False):
        super().__init__()
        self.route = route
        self.router_fp32 = router_fp32  # DeepSeek computes router logits in float32
        self.gate = nn.Linear(hidden, num_experts, bias=router_bias)
        self.experts = Experts(num_experts, hidden, intermediate, expert_bias, activation)
        self.shared_expert = DenseMLP(hidden, shared_intermediate) if shared_intermediate else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_gate else None
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts), requires_grad=False)
                                        if correction_bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.router_fp32:
            logits = F.linear(x.float(), self.gate.weight.float(),
                              None if self.gate.bias is None else self.gate.bias.float())
        else:
            logits = self.gate(x)
        weights, ids = self.route(logits, self.e_score_correction_bias)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
