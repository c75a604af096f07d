"""Tensor parallelism for the hybrids (Qwen3.5 text, Qwen3-Next; Nemotron-H, Granite 4.0-H,
Falcon-H1): the model is loaded whole, then each layer keeps its rank's heads.

- Gated DeltaNet: a rank keeps a contiguous share of the key heads and the value heads that go
  with them (value head j reads key head j // (value heads / key heads), so the shares line up):
  their q, k and v projection rows, convolution channels, z, b and a rows, A_log and dt_bias;
  out_proj keeps the matching input columns and the layer's output is summed over ranks. The
  per-head gated norm is whole on every rank.
- The gated attention: each rank's query heads (with their gate rows, which q_proj interleaves
  per head) and KV heads, as plain attention splits them (tp_shard._shard_attention's rule).
- Mamba2: a rank keeps its heads and the groups whose B and C they read (whole groups, so the
  gated norm, which normalises within a group, needs no sum across ranks): n_groups must be a
  multiple of the degree.
- The fused attention (Nemotron-H, Granite, Falcon-H1): query and KV heads as plain attention's.
- MLPs and MoE blocks (Nemotron-H's ungated experts: their up rows and down columns),
  embedding and LM head: as tp_shard cuts them.

The recurrent-state pool stays whole, like the KV cache (pdserve.executor.kv_shared): one
shared arena with every head's window and state, the layout of TP 1, so a state handed over or
cached by a node at one degree is read by a node at any other. Each rank's layer reads and
writes its heads' part of it (GatedDeltaNet.conv_parts, first_v_head).
"""
from __future__ import annotations

import torch
from torch import nn

from pdserve.layers.parallel import TPGroup, divide
from pdserve.models.gated_deltanet import GatedDeltaNet, GroupedGatedDeltaNet
from pdserve.models.hybrid import HybridAttention
from pdserve.models.mamba2_mixer import Mamba2Mixer
from pdserve.models.moe import SparseMoE
from pdserve.models.nemotron_h import SquaredReluMLP
from pdserve.models.nemotron_h_moe import NemotronHMoE, UngatedExperts
from pdserve.models.qwen3_5 import GatedAttention
from pdserve.models.tp_shard import (
    _keep,
    _keep_columns,
    _keep_rows,
    _once,
    _rows,
    _shard_dense,
    _shard_moe,
    _shard_vocab,
    _sum_output,
    kv_share,
)

# The hybrid architectures whose every layer this module splits (Qwen3.5 with images: its
# language model's; the tower stays whole on rank 0, which encodes and sends the embeddings, as
# Qwen2.5-VL's does).
HYBRID_TP_FAMILIES = ("Qwen3_5ForCausalLM", "Qwen3NextForCausalLM", "NemotronHForCausalLM",
                      "GraniteMoeHybridForCausalLM", "FalconH1ForCausalLM", "Qwen3_5ForConditionalGeneration")
# A layer's token mixers and MLPs, by the names the families give them; each one's output is
# summed over ranks (Granite's MoE and shared MLP apart, Falcon-H1's Mamba and attention apart).
_PARTS = ("mixer", "self_attn", "mlp", "shared_mlp", "moe")


def shard_hybrid_model(model: nn.Module, group: TPGroup) -> nn.Module:
    for layer in model.layers:
        for name in _PARTS:
            part = getattr(layer, name, None)
            if part is not None:
                _shard_part(part, group)
                _sum_output(part, group)
    _shard_vocab(model, group)
    return model


def _shard_part(part: nn.Module, group: TPGroup) -> None:
    if isinstance(part, GatedDeltaNet):
        _shard_gated_deltanet(part, group)
    elif isinstance(part, GatedAttention):
        _shard_gated_attention(part, group)
    elif isinstance(part, Mamba2Mixer):
        _shard_mamba2(part, group)
    elif isinstance(part, HybridAttention):
        _shard_fused_attention(part, group)
    elif isinstance(part, SparseMoE):
        _shard_moe(part, group, expert_parallel=False)
    elif isinstance(part, NemotronHMoE):
        _shard_ungated_experts(part.experts, group)
        _shard_ungated_mlp(part.shared_experts, group)
    elif isinstance(part, SquaredReluMLP):
        _shard_ungated_mlp(part, group)
    elif hasattr(part, "gate_up_proj") and hasattr(part, "down_proj"):  # DenseMLP, Falcon-H1's MLP
        _shard_dense(part, group)
    else:
        raise ValueError(f"tensor parallelism does not know how to split {type(part).__name__}")


def _head_rows(first: int, count: int, per_head: int) -> torch.Tensor:
    return _rows(first * per_head, count * per_head)


def _shard_gated_deltanet(layer: GatedDeltaNet, group: TPGroup) -> None:
    k_heads = divide(layer.num_k_heads, group.size, "linear-attention key heads")
    v_heads = divide(layer.num_v_heads, group.size, "linear-attention value heads")
    k0, v0 = group.rank * k_heads, group.rank * v_heads
    # The convolution's channels in the pool's (TP 1) order: q, k, v; this rank's part of each.
    q = _head_rows(k0, k_heads, layer.k_dim)
    k = q + layer.key_size
    v = _head_rows(v0, v_heads, layer.v_dim) + 2 * layer.key_size
    channels = torch.cat([q, k, v])
    if isinstance(layer, GroupedGatedDeltaNet):
        _shard_grouped_projections(layer, group.rank, k_heads)
    else:
        _keep_rows(layer.in_proj_qkv, channels)
        _keep_rows(layer.in_proj_z, _head_rows(v0, v_heads, layer.v_dim))
        _keep_rows(layer.in_proj_b, _rows(v0, v_heads))
        _keep_rows(layer.in_proj_a, _rows(v0, v_heads))
    layer.conv1d.weight = _keep(layer.conv1d.weight, 0, channels)
    layer.dt_bias = _keep(layer.dt_bias, 0, _rows(v0, v_heads))
    layer.A_log = _keep(layer.A_log, 0, _rows(v0, v_heads))
    _keep_columns(layer.out_proj, _head_rows(v0, v_heads, layer.v_dim))
    layer.conv_parts = [(int(part[0]), part.numel()) for part in (q, k, v)]
    layer.first_v_head = v0
    layer.num_k_heads, layer.num_v_heads = k_heads, v_heads
    layer.key_size, layer.value_size = k_heads * layer.k_dim, v_heads * layer.v_dim
    layer.conv_size = 2 * layer.key_size + layer.value_size


def _shard_grouped_projections(layer: GroupedGatedDeltaNet, rank: int, k_heads: int) -> None:
    """Qwen3-Next's projections hold each key head's q, k, v and z (and b, a) together: a rank's
    key heads are one run of rows in each."""
    per = layer.num_v_heads // layer.num_k_heads
    qkvz_per_head = 2 * layer.k_dim + 2 * per * layer.v_dim
    _keep_rows(layer.in_proj_qkvz, _head_rows(rank * k_heads, k_heads, qkvz_per_head))
    _keep_rows(layer.in_proj_ba, _head_rows(rank * k_heads, k_heads, 2 * per))


def _shard_gated_attention(attn: GatedAttention, group: TPGroup) -> None:
    """Query heads (each q_proj head's query rows, then its gate rows) and KV heads split as
    plain attention's; o_proj keeps the heads' columns. q_norm and k_norm act per head: whole."""
    d, heads, kv_heads = attn.head_dim, attn.num_heads, attn.num_kv_heads
    local = divide(heads, group.size, "attention heads")
    local_kv, kv0 = kv_share(kv_heads, group)
    q_gate = _head_rows(group.rank * local, local, 2 * d)
    k = _head_rows(kv0, local_kv, d) + 2 * attn.q_size
    _keep_rows(attn.qkv_proj, torch.cat([q_gate, k, k + attn.kv_size]))
    _keep_columns(attn.o_proj, _head_rows(group.rank * local, local, d))
    attn.num_heads, attn.num_kv_heads = local, local_kv
    attn.q_size, attn.kv_size = local * d, local_kv * d


def _shard_mamba2(layer: Mamba2Mixer, group: TPGroup) -> None:
    """A rank keeps its heads and the groups they read B and C from (whole groups: the gated
    norm normalises within a group, so no rank needs another's sums): their z, x, B, C and dt
    projection rows (Falcon-H1's multipliers alike), convolution channels, dt_bias, A_log, D and
    norm weights; out_proj keeps the heads' columns."""
    heads = divide(layer.heads, group.size, "Mamba2 heads")
    groups = divide(layer.groups, group.size, "Mamba2 groups (n_groups)")
    h0, g0, bc = group.rank * heads, group.rank * groups, layer.groups * layer.state_size
    x = _head_rows(h0, heads, layer.head_dim)
    b = _head_rows(g0, groups, layer.state_size) + layer.inner
    c = b + bc
    channels = torch.cat([x, b, c])
    dt = _rows(h0, heads) + layer.inner + layer.conv_size
    rows = torch.cat([x, channels + layer.inner, dt])
    _keep_rows(layer.in_proj, rows)
    if getattr(layer, "mup", None) is not None:  # Falcon-H1's per-row multipliers of in_proj
        layer.mup = layer.mup.index_select(0, rows)
    layer.conv1d.weight = _keep(layer.conv1d.weight, 0, channels)
    layer.conv1d.bias = _keep(layer.conv1d.bias, 0, channels)
    for name in ("dt_bias", "A_log", "D"):
        setattr(layer, name, _keep(getattr(layer, name), 0, _rows(h0, heads)))
    if layer.norm is not None:
        layer.norm.weight = _keep(layer.norm.weight, 0, x)
        layer.norm.groups = groups
    _keep_columns(layer.out_proj, x)
    _once(layer.out_proj.bias, group)
    layer.conv_parts = [(int(part[0]), part.numel()) for part in (x, b, c)]
    layer.first_head = h0
    layer.heads, layer.groups, layer.inner = heads, groups, heads * layer.head_dim
    layer.conv_size = layer.inner + 2 * groups * layer.state_size


def _shard_fused_attention(attn: HybridAttention, group: TPGroup) -> None:
    """Nemotron-H's, Granite's and Falcon-H1's attention: q, k and v fused, one block each."""
    d, local = attn.head_dim, divide(attn.num_heads, group.size, "attention heads")
    local_kv, kv0 = kv_share(attn.num_kv_heads, group)
    q = _head_rows(group.rank * local, local, d)
    k = _head_rows(kv0, local_kv, d) + attn.q_size
    _keep_rows(attn.qkv_proj, torch.cat([q, k, k + attn.kv_size]))
    _keep_columns(attn.o_proj, q)
    _once(attn.o_proj.bias, group)
    attn.num_heads, attn.num_kv_heads = local, local_kv
    attn.q_size, attn.kv_size = local * d, local_kv * d


def _shard_ungated_mlp(mlp: SquaredReluMLP, group: TPGroup) -> None:
    part = divide(mlp.down_proj.weight.shape[1], group.size, "intermediate size")
    cols = _rows(group.rank * part, part)
    _keep_rows(mlp.up_proj, cols)
    _keep_columns(mlp.down_proj, cols)
    _once(mlp.down_proj.bias, group)


def _shard_ungated_experts(experts: UngatedExperts, group: TPGroup) -> None:
    """Each expert's slice of its up rows ([E, I, H]) and down columns ([E, H, I])."""
    part = divide(experts.intermediate, group.size, "expert intermediate size")
    cols = _rows(group.rank * part, part)
    experts.gate_up_proj = _keep(experts.gate_up_proj, 1, cols)
    experts.down_proj = _keep(experts.down_proj, 2, cols)
    experts.intermediate = part
