"""The compatibility handshake: nodes whose KV would differ are never paired.

Each node's pongs carry a KVCompat (pdserve.wire.compat); the router's pool admits one group of
nodes whose KV agrees and refuses the rest (pdserve.router.dispatch.compat_gate). These tests
feed pongs to a real NodePool, one mismatch at a time, and check what the router would route
to; the cluster test with two nodes that really differ is tests/test_handshake_cluster.py.
"""
from __future__ import annotations

import msgspec
import pytest

from pdserve.node.compat import files_digest
from pdserve.router.dispatch.health_report import HealthReport
from pdserve.router.dispatch.nodes import Node, NodePool
from pdserve.wire.compat import KVCompat
from pdserve.wire.messages import Pong, decode, encode

BASE = KVCompat("a" * 32, "float32", "float32", 16, 2, 4, 2, 32)

# One field at a time, each a way two nodes' KV would be different bytes.
MISMATCHES = {
    "model weights": {"model_digest": "b" * 32},
    "dtype": {"dtype": "bfloat16"},
    "KV cache dtype": {"kv_dtype": "float8_e4m3fn"},
    "block size": {"block_size": 32},
    "KV planes": {"kv_planes": 1, "num_kv_heads": 1, "head_dim": 96},  # an MLA latent
    "layers": {"num_layers": 6},
    "KV heads": {"num_kv_heads": 4},
    "head dim": {"head_dim": 64},
    "cache layout": {"cache_layout": "per-rank-v1"},
}
# What the handover bridges: every cache holds every head and layer, speculation is decode-side.
BRIDGED = {"tensor parallel": {"tensor_parallel_size": 2}, "pipeline parallel": {"pipeline_parallel_size": 2},
           "speculative": {"speculative": "ngram:4:"}, "an extra adapter": {"loras": {"extra": "f" * 32}}}


def _pool(*roles: str) -> NodePool:
    pool = NodePool([], [], on_message=lambda node, msg: None, on_dead=lambda node: None)
    for i, role in enumerate(roles):
        pool.nodes.append(Node(f"{role}-{i}", role, f"tcp://127.0.0.1:{9000 + i}", sock=None))
    return pool


def _pong(pool: NodePool, node_id: str, compat: KVCompat) -> bool:
    node = pool.get(node_id)
    msg = decode(encode(Pong(1, node_id, node.role, compat=compat)))  # as it travels
    return pool.take_pong(node, msg)


def _routable(pool: NodePool) -> set[str]:
    return {n.node_id for role in ("prefill", "decode") for n in pool.by_role(role)}


@pytest.mark.parametrize("what", sorted(MISMATCHES))
def test_a_node_whose_kv_differs_is_refused(what):
    pool = _pool("prefill", "decode", "decode")
    odd = msgspec.structs.replace(BASE, **MISMATCHES[what])
    assert _pong(pool, "prefill-0", BASE) and _pong(pool, "decode-1", BASE)
    assert not _pong(pool, "decode-2", odd)
    assert _routable(pool) == {"prefill-0", "decode-1"}
    node = pool.get("decode-2")
    assert node.refused and not node.healthy and what in node.refusal
    report = HealthReport(pool, _Stub(), _Stub(), _Stub(), _Stub(), "nixl")
    entry = report.node_entry(node)
    assert what in entry["refused"]
    assert "refused" not in report.node_entry(pool.get("decode-1"))


@pytest.mark.parametrize("what", sorted(BRIDGED))
def test_what_the_handover_bridges_is_not_refused(what):
    pool = _pool("prefill", "decode")
    assert _pong(pool, "prefill-0", BASE)
    assert _pong(pool, "decode-1", msgspec.structs.replace(BASE, **BRIDGED[what]))
    assert _routable(pool) == {"prefill-0", "decode-1"}


def test_an_adapter_of_one_name_must_have_the_same_weights():
    pool = _pool("prefill", "decode", "decode")
    assert _pong(pool, "prefill-0", msgspec.structs.replace(BASE, loras={"sql": "1" * 32}))
    assert _pong(pool, "decode-1", msgspec.structs.replace(BASE, loras={"sql": "1" * 32, "chat": "2" * 32}))
    assert not _pong(pool, "decode-2", msgspec.structs.replace(BASE, loras={"sql": "9" * 32}))
    assert "LoRA adapter 'sql'" in pool.get("decode-2").refusal
    assert _routable(pool) == {"prefill-0", "decode-1"}


def test_one_odd_node_heard_first_does_not_lock_out_the_rest():
    """The admitted group is the larger one with a decode node, whichever pongs first."""
    pool = _pool("prefill", "prefill", "decode", "decode")
    odd = msgspec.structs.replace(BASE, block_size=32)
    assert _pong(pool, "prefill-0", odd)  # alone, it is the group
    for node_id in ("prefill-1", "decode-2", "decode-3"):
        _pong(pool, node_id, BASE)  # (refused while the groups tie)
    assert not _pong(pool, "prefill-0", odd)  # outnumbered: its next pong is refused
    assert all(_pong(pool, node_id, BASE) for node_id in ("prefill-1", "decode-2", "decode-3"))
    assert _routable(pool) == {"prefill-1", "decode-2", "decode-3"}


def test_a_refused_node_is_admitted_once_it_agrees():
    """A node restarted with the cluster's settings rejoins; one that left frees its group."""
    pool = _pool("prefill", "decode")
    assert _pong(pool, "decode-1", BASE)
    fp8 = msgspec.structs.replace(BASE, kv_dtype="float8_e4m3fn")
    assert not _pong(pool, "prefill-0", fp8)
    assert _pong(pool, "prefill-0", BASE)
    assert _routable(pool) == {"prefill-0", "decode-1"} and not pool.get("prefill-0").refusal


def test_the_weights_digest_names_the_bytes_not_the_path(tmp_path):
    """Same files at two paths: one digest; one byte changed in the weights: another."""
    for name in ("a", "b", "c"):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text('{"hidden_size": 8}')
        (d / "model.safetensors").write_bytes(bytes(range(256)) * 64)
        (d / "tokenizer.json").write_text(name)  # tokenizers do not touch the KV
    weights = tmp_path / "c" / "model.safetensors"
    weights.write_bytes(b"\x01" + weights.read_bytes()[1:])
    assert files_digest(tmp_path / "a") == files_digest(tmp_path / "b") != files_digest(tmp_path / "c")


class _Stub:
    """The parts of the health report a node entry reads, as empty as a fresh router's."""

    def size(self, node_id):
        return 0

    def seq(self, node_id):
        return 0

    def state(self, node_id):
        return "active"

    def report(self, node_id):
        return {}
