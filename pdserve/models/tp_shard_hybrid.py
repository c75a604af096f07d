"""Tensor parallelism for the linear-attention hybrids (Qwen3.5 text, Qwen3-Next): the model is
loaded whole, then each layer keeps its rank's heads.

- Gated DeltaNet: a rank keeps a contiguous share of the key heads and the value heads that go
  with them (value head j reads key head j // (value heads / key heads), so the shares line up):
  their q, k and v projection rows, convolution channels, z, b and a rows, A_log and dt_bias;
  out_proj keeps the matching input columns and the layer's output is summed over ranks. The
  per-head gated norm is whole on every rank.
- The gated attention: each rank's query heads (with their gate rows, which q_proj interleaves
  per head) and KV heads, as plain attention splits them (tp_shard._shard_attention's rule).
- MLPs and MoE blocks, embedding and LM head: as tp_shard cuts them.

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
from pdserve.models.moe import DenseMLP, SparseMoE
from pdserve.models.qwen3_5 import GatedAttention
from pdserve.models.tp_shard import (
    _keep,
    _keep_columns,
    _keep_rows,
    _rows,
    _shard_dense,
    _shard_moe,
    _shard_vocab,
    _sum_output,
    kv_share,
)

# The hybrid architectures whose every layer this module splits.
HYBRID_TP_FAMILIES = ("Qwen3_5ForCausalLM", "Qwen3NextForCausalLM")


def shard_hybrid_model(model: nn.Module, group: TPGroup) -> nn.Module:
    for layer in model.layers:
        mixer = layer.mixer
        if isinstance(mixer, GatedDeltaNet):
            _shard_gated_deltanet(mixer, group)
        elif isinstance(mixer, GatedAttention):
            _shard_gated_attention(mixer, group)
        else:
            raise ValueError(f"tensor parallelism does not know how to split {type(mixer).__name__}")
        _sum_output(mixer, group)
        if isinstance(layer.mlp, SparseMoE):
            _shard_moe(layer.mlp, group, expert_parallel=False)
        elif isinstance(layer.mlp, DenseMLP):
            _shard_dense(layer.mlp, group)
        else:
            raise ValueError(f"tensor parallelism does not know how to split {type(layer.mlp).__name__}")
        _sum_output(layer.mlp, group)
    _shard_vocab(model, group)
    return model


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
