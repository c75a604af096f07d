"""pdserve.layers against plain torch: each tensor-parallel linear layer and the vocabulary-
parallel embedding and LM head, loaded from whole checkpoint tensors at TP 2 in two real
processes over gloo, give the output of the unsharded layer on every rank (TP 1 too)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pdserve.layers.loading import load_param
from pdserve.layers.parallel import TPGroup, set_tp_group
from pdserve.layers.vocab import ParallelLMHead, VocabParallelEmbedding

HIDDEN, HEAD_DIM, HEADS = 16, 4, 4


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {"x": r(5, HIDDEN), "q": r(HEADS * HEAD_DIM, HIDDEN), "k": r(HEAD_DIM, HIDDEN), "v": r(HEAD_DIM, HIDDEN),
            "qb": r(HEADS * HEAD_DIM), "kb": r(HEAD_DIM), "vb": r(HEAD_DIM), "gate": r(24, HIDDEN), "up": r(24, HIDDEN),
            "down": r(HIDDEN, 24), "down_b": r(HIDDEN), "embed": r(11, HIDDEN), "ids": torch.tensor([0, 3, 10, 5, 7])}


def _check(rank: int) -> None:
    """Build each layer at this process's TP rank, load whole tensors, compare with torch."""
    t = _tensors()
    x = t["x"]
    # One KV head over two ranks: replicated, so each rank's k/v equal the whole head's.
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, 1, bias=True)
    for part, name in enumerate("qkv"):
        qkv.weight_loader("weight", t[name], part)
        qkv.weight_loader("bias", t[name + "b"], part)
    q, k, v = qkv(x).split([qkv.num_heads * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=-1)
    size = qkv.tp.size
    q_ref = (x @ t["q"].T + t["qb"]).chunk(size, dim=-1)[rank]
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, x @ t["k"].T + t["kb"])
    torch.testing.assert_close(v, x @ t["v"].T + t["vb"])
    # Column then row: gate/up column-parallel, down row-parallel with one all-reduce.
    gate_up = MergedColumnParallelLinear(HIDDEN, [24, 24])
    gate_up.weight_loader("weight", t["gate"], 0)
    gate_up.weight_loader("weight", t["up"], 1)
    down = RowParallelLinear(24, HIDDEN, bias=True)
    down.weight_loader("weight", t["down"])
    down.weight_loader("bias", t["down_b"])
    gate, up = gate_up(x).split(gate_up.output_sizes[0], dim=-1)
    ref_gate, ref_up = x @ t["gate"].T, x @ t["up"].T
    torch.testing.assert_close(down(gate * up), (ref_gate * ref_up) @ t["down"].T + t["down_b"])
    column = ColumnParallelLinear(HIDDEN, 24, gather_output=True)
    column.weight_loader("weight", t["gate"])
    torch.testing.assert_close(column(x), ref_gate)
    replicated = ReplicatedLinear(HIDDEN, 24)
    replicated.weight_loader("weight", t["gate"])
    torch.testing.assert_close(replicated(x), ref_gate)
    # Vocabulary of 11 over 2 ranks: padded to 12, the padding row's logit cut off.
    embed, head = VocabParallelEmbedding(11, HIDDEN), ParallelLMHead(11, HIDDEN)
    model = torch.nn.Module()
    model.embed, model.head = embed, head
    load_param(model, "embed.weight", t["embed"])
    load_param(model, "head.weight", t["embed"])
    torch.testing.assert_close(embed(t["ids"]), t["embed"][t["ids"]])
    torch.testing.assert_close(head(x), x @ t["embed"].T)


def _rank_main(rank: int, rendezvous_file: str) -> None:
    # A file rendezvous, not a port picked in advance: on a busy CI machine another test could
    # take that port between the pick and the bind, and rank 1 then met a stranger's store.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous_file}", rank=rank, world_size=2)
    set_tp_group(TPGroup(rank, 2, dist.group.WORLD))
    _check(rank)
    # Both ranks are past their last collective, then leave without running gloo's destructors:
    # destroy_process_group (even after a barrier) sometimes aborted a rank in CI with
    # "terminate called without an active exception" (SIGABRT). The check above is done, so
    # the exit code is all mp.spawn needs.
    dist.barrier()
    os._exit(0)


def test_layers_tp1_match_torch():
    set_tp_group(None)
    _check(0)


@pytest.mark.timeout(120)
def test_layers_tp2_match_torch(tmp_path):
    mp.spawn(_rank_main, args=(str(tmp_path / "rendezvous"),), nprocs=2, join=True)
