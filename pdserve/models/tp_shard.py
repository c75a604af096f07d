"""Tensor parallelism for the families still built from whole nn.Linear layers (Qwen3-MoE,
Qwen2-MoE, Mixtral, gpt-oss, DeepSeek-V2/V3): the model is loaded whole, then each module keeps
its rank's slice.

- Attention: qkv_proj keeps this rank's query heads and KV heads (a KV head is replicated on
  size // kv_heads ranks when there are fewer than ranks, as QKVParallelLinear does); o_proj
  keeps the matching input columns, and the attention's output is summed over ranks.
- MoE, tensor-parallel (the default): every expert keeps its slice of the intermediate rows
  (gate and up) and columns (down); the shared expert too. One all-reduce sums the MoE block.
- MoE, expert-parallel (enable_expert_parallel): each rank keeps size-th of the experts whole
  and computes only the (token, expert) pairs routed to them; the all-reduce sums the ranks'
  contributions. The shared expert is tensor-parallel as above.
  MXFP4 experts (gpt-oss) are cut the same way with their scales, on whole groups of 32.
- FP8 block layers and experts (DeepSeek-V3's checkpoints) keep their bytes and per-row scales:
  a row split keeps the rows' scales, a column split keeps whole blocks of 128 columns (the
  activations' groups then fall where they fall unsplit, so the result is TP 1's).
- Dense MLP layers: gate/up rows and down columns split, one all-reduce.
- MLA (DeepSeek): the heads split; the latent and its cache replicated (see _shard_mla).
- Embedding and LM head: vocabulary-parallel (pdserve.layers.vocab).

A bias added after a sum is kept on rank 0 only (zero elsewhere), so it is added once. The
router's gate and the norms are replicated.
"""
from __future__ import annotations

import dataclasses
import types

import torch
from torch import nn

from pdserve.layers.parallel import TPGroup, divide, get_tp_group, set_tp_group
from pdserve.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from pdserve.models.attention import PagedAttention
from pdserve.models.mla import MLAttention
from pdserve.models.moe import DenseMLP, Experts, SparseMoE
from pdserve.models.moe_quant import Fp8Experts, Mxfp4Experts


def shard_decoder_model(model: nn.Module, group: TPGroup, expert_parallel: bool = False) -> nn.Module:
    for layer in model.layers:
        if isinstance(layer.self_attn, MLAttention):
            _shard_mla(layer.self_attn, group)
        else:
            _shard_attention(layer.self_attn, group)
        _sum_output(layer.self_attn, group)
        mlp = layer.mlp
        if isinstance(mlp, SparseMoE):
            _shard_moe(mlp, group, expert_parallel)
        elif isinstance(mlp, DenseMLP):
            _shard_dense(mlp, group)
        else:
            raise ValueError(f"tensor parallelism does not know how to split {type(mlp).__name__}")
        _sum_output(mlp, group)
    _shard_vocab(model, group)
    return model


def _sum_output(module: nn.Module, group: TPGroup) -> None:
    module.register_forward_hook(lambda _m, _inputs, out: group.all_reduce(out))
    module.tp_sum_group = group  # the compiled decode step sums there too (decoder.summing_group)


def _keep(param: torch.Tensor | None, dim: int, index: torch.Tensor) -> nn.Parameter | None:
    if param is None:
        return None
    return nn.Parameter(param.data.index_select(dim, index).contiguous(), requires_grad=False)


def _once(param: nn.Parameter | None, group: TPGroup) -> None:
    """A bias added after the ranks' sum: rank 0 adds it."""
    if param is not None and group.rank != 0:
        param.data.zero_()


def _rows(start: int, count: int) -> torch.Tensor:
    return torch.arange(start, start + count)


def _keep_rows(linear: nn.Module, rows: torch.Tensor) -> None:
    """Output rows of a float or FP8 linear layer (an FP8 layer's scales are per row)."""
    linear.weight = _keep(linear.weight, 0, rows)
    linear.bias = _keep(linear.bias, 0, rows)
    if getattr(linear, "weight_scale", None) is not None:
        linear.weight_scale = _keep(linear.weight_scale, 0, rows)


def _keep_columns(linear: nn.Module, cols: torch.Tensor) -> None:
    """Input columns of a float or FP8 linear layer (an FP8 layer's: whole blocks of them)."""
    if getattr(linear, "weight_scale", None) is not None:
        blocks = _whole_blocks(cols, linear.act_block, linear.weight.shape[1])
        linear.weight_scale = _keep(linear.weight_scale, 1, blocks)
    linear.weight = _keep(linear.weight, 1, cols)


def _whole_blocks(cols: torch.Tensor, block: int, width: int) -> torch.Tensor:
    """The scale columns of a run of FP8 columns, which must start on a block and end on one
    or at the matrix's last column (of `width`): a rank's activations are then quantized in the
    groups the unsplit layer uses."""
    start, end = int(cols[0]), int(cols[-1]) + 1
    if start % block or (end % block and end != width):
        raise ValueError(f"FP8 block weights split {end - start} input columns a rank at column {start}: "
                         f"tensor parallelism needs whole blocks of {block} columns a rank; choose a "
                         f"tensor_parallel_size that keeps them whole")
    return _rows(start // block, -(-(end - start) // block))


def kv_share(kv_heads: int, group: TPGroup) -> tuple[int, int]:
    """(KV heads a rank keeps, its first): a contiguous share each, or with fewer KV heads than
    ranks one head replicated on size // kv_heads ranks (as QKVParallelLinear splits them)."""
    if kv_heads >= group.size:
        local = divide(kv_heads, group.size, "KV heads")
        return local, group.rank * local
    return 1, group.rank // divide(group.size, kv_heads, "ranks per KV head")


def _shard_attention(attn: PagedAttention, group: TPGroup) -> None:
    d, heads, kv_heads = attn.head_dim, attn.num_heads, attn.num_kv_heads
    local_heads = divide(heads, group.size, "attention heads")
    local_kv, kv_start = kv_share(kv_heads, group)
    q = _rows(group.rank * local_heads * d, local_heads * d)
    k = _rows(heads * d + kv_start * d, local_kv * d)
    v = k + kv_heads * d
    keep = torch.cat([q, k, v])
    _keep_rows(attn.qkv_proj, keep)
    _keep_columns(attn.o_proj, q)
    _once(attn.o_proj.bias, group)
    if attn.sinks is not None:
        attn.sinks = _keep(attn.sinks, 0, _rows(group.rank * local_heads, local_heads))
    attn.num_heads, attn.num_kv_heads = local_heads, local_kv
    attn.q_size, attn.kv_size = local_heads * d, local_kv * d


def _shard_mla(attn: MLAttention, group: TPGroup) -> None:
    """Heads split: the query up-projection, kv_b_proj (each head's key and value rows) and
    o_proj's columns keep this rank's heads. The latent (q_a, kv_a and their norms) is
    replicated, and so is the latent cache: every rank writes the same bytes to it."""
    s = attn.spec
    local = divide(s.num_heads, group.size, "attention heads")
    heads = _rows(group.rank * local, local)

    def head_rows(per_head: int) -> torch.Tensor:
        return (heads[:, None] * per_head + torch.arange(per_head)).reshape(-1)

    q = attn.q_proj if s.q_lora_rank is None else attn.q_b_proj
    _keep_rows(q, head_rows(s.qk_head_dim))
    _keep_rows(attn.kv_b_proj, head_rows(s.qk_nope_head_dim + s.v_head_dim))
    _keep_columns(attn.o_proj, head_rows(s.v_head_dim))
    _once(attn.o_proj.bias, group)
    attn.spec = dataclasses.replace(s, num_heads=local)


def _intermediate_slice(intermediate: int, group: TPGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of [gate | up] to keep, columns of down to keep) for this rank."""
    part = divide(intermediate, group.size, "intermediate size")
    cols = _rows(group.rank * part, part)
    return torch.cat([cols, cols + intermediate]), cols


def _shard_dense(mlp: DenseMLP, group: TPGroup) -> None:
    rows, cols = _intermediate_slice(mlp.down_proj.weight.shape[1], group)
    _keep_rows(mlp.gate_up_proj, rows)
    _keep_columns(mlp.down_proj, cols)
    _once(mlp.down_proj.bias, group)


def _shard_moe(moe: SparseMoE, group: TPGroup, expert_parallel: bool) -> None:
    experts = moe.experts
    if expert_parallel:
        local = divide(experts.num_experts, group.size, "experts")
        keep = _rows(group.rank * local, local)
        for name in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias", "gate_up_scale", "down_scale"):
            if hasattr(experts, name):  # (the scales: quantized experts', pdserve.models.moe_quant)
                setattr(experts, name, _keep(getattr(experts, name), 0, keep))
        experts.first_expert, experts.num_experts = group.rank * local, local
        experts.forward = types.MethodType(_expert_parallel_forward, experts)
    else:
        rows, cols = _intermediate_slice(experts.intermediate, group)
        experts.gate_up_proj = _keep(experts.gate_up_proj, 1, rows)
        experts.gate_up_bias = _keep(experts.gate_up_bias, 1, rows)
        if isinstance(experts, Mxfp4Experts):
            _shard_mxfp4_packed(experts, rows, cols)
        else:
            if isinstance(experts, Fp8Experts):  # per-row scales, and down's in whole blocks
                experts.gate_up_scale = _keep(experts.gate_up_scale, 1, rows)
                blocks = _whole_blocks(cols, experts.block, experts.intermediate)
                experts.down_scale = _keep(experts.down_scale, 2, blocks)
            experts.down_proj = _keep(experts.down_proj, 2, cols)
        _once(experts.down_bias, group)
        experts.intermediate = cols.numel()
    if moe.shared_expert is not None:
        _shard_dense(moe.shared_expert, group)


def _shard_mxfp4_packed(experts: Mxfp4Experts, rows: torch.Tensor, cols: torch.Tensor) -> None:
    """The rest of MXFP4 experts: gate_up's scales by row; down_proj holds its columns two to a
    byte and one scale per 32, so a rank's columns must start and end on a group of 32
    (gpt-oss's 2880 split in two is 45 groups each)."""
    start, count = int(cols[0]), cols.numel()
    if start % 32 or count % 32:
        raise ValueError(f"MXFP4 experts split {count} intermediate columns a rank at column {start}: "
                         f"tensor parallelism needs whole groups of 32 (use --enable-expert-parallel)")
    experts.gate_up_scale = _keep(experts.gate_up_scale, 1, rows)
    experts.down_proj = _keep(experts.down_proj, 2, _rows(start // 2, count // 2))
    experts.down_scale = _keep(experts.down_scale, 2, _rows(start // 32, count // 32))


def _expert_parallel_forward(self: Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Only the (token, slot) pairs routed to this rank's experts, each as a one-expert row."""
    local = (ids >= self.first_expert) & (ids < self.first_expert + self.num_experts)
    token, slot = local.nonzero(as_tuple=True)
    out = torch.zeros_like(x)
    if token.numel():
        picked = Experts.forward(self, x[token], (ids[token, slot] - self.first_expert)[:, None],
                                 weights[token, slot][:, None])
        out.index_add_(0, token, picked)
    return out


def _shard_vocab(model: nn.Module, group: TPGroup) -> None:
    previous = get_tp_group()
    set_tp_group(group)  # the vocabulary layers read the group as they are built
    try:
        embed = model.embed_tokens.weight.data
        vocab, hidden = embed.shape
        new_embed = VocabParallelEmbedding(vocab, hidden, params_dtype=embed.dtype).to(embed.device)
        new_embed.weight_loader("weight", embed)
        head = ParallelLMHead(vocab, hidden, params_dtype=embed.dtype).to(embed.device)
        tied = model.lm_head.weight.data_ptr() == embed.data_ptr()
        if tied:
            head.weight = new_embed.weight
        else:
            head.weight_loader("weight", model.lm_head.weight.data)
    finally:
        set_tp_group(previous)
    model.embed_tokens, model.lm_head = new_embed, head
