"""Encoder nodes (E/P/D) in each launcher's plan, without starting anything: `pdserve up` gives
them the embeddings' path the KV takes (NIXL needs no Redis), `pdserve up --ray` has an encode
template each actor fills in on its own machine and a controller that starts the role (the
compose file's `epd` profile: tests/test_compose.py). Every command line goes through pdserve's
own parser. (tests/test_vlm_epd_cluster.py runs encoder nodes for real.)
"""
from __future__ import annotations

import threading

import pytest

from pdserve.cluster.ray_actors import fill_template, template_ports
from pdserve.cluster.ray_controller import Placement, RayController
from pdserve.entrypoints.cli import build_parser
from pdserve.entrypoints.launcher import Cluster
from pdserve.entrypoints.ray_launch import node_counts, node_templates, placement


def _up(*flags: str):
    return build_parser().parse_args(["up", "--model", "builtin:tiny", *flags])


def _parse(argv: list[str]):
    return build_parser().parse_args(argv)


def test_pdserve_up_hands_embeddings_over_nixl_without_redis():
    args = _up("--kv-transfer", "nixl", "--encode-nodes", "2")
    cluster = Cluster(args)
    cluster._store = cluster._store_url()
    assert cluster._store is None and cluster._encode_nodes() == 2  # no store needed
    extra = cluster._encode_flags() + ["--num-kv-blocks", "16"]
    node = _parse(cluster.node_cmd("encode", "encode-0", "tcp://127.0.0.1:5600", extra)[3:])
    assert node.command == "encode" and node.store is None
    assert node.nixl_side_channel.startswith("tcp://127.0.0.1:") and node.num_kv_blocks == 16


def test_pdserve_up_through_the_store_gives_encoder_nodes_the_store():
    args = _up("--kv-transfer", "store", "--store", "redis://127.0.0.1:6390", "--encode-nodes", "1")
    cluster = Cluster(args)
    cluster._store = cluster._store_url()
    node = _parse(cluster.node_cmd("encode", "encode-0", "tcp://127.0.0.1:5600", cluster._encode_flags())[3:])
    assert node.store == "redis://127.0.0.1:6390" and node.nixl_side_channel is None


@pytest.mark.parametrize("transfer", ["nixl", "store"])
def test_ray_encode_template_binds_and_advertises_its_machine(transfer):
    args = _up("--ray", "auto", "--kv-transfer", transfer, "--store", "redis://10.0.0.5:6379",
               "--encode-nodes", "1", "--ray-encode-resource", "vision_host")
    template = [a.replace("{node_id}", "encode-0") for a in node_templates(args, Cluster(args))["encode"]]
    ports = {"control": 5600, "side": 5601}
    assert template_ports(template) == (["control", "side"] if transfer == "nixl" else ["control"])
    node = _parse(fill_template(template, "10.0.0.7", ports))
    assert (node.command, node.node_id, node.bind) == ("encode", "encode-0", "tcp://10.0.0.7:5600")
    assert node.advertise_host == "10.0.0.7" and node.num_kv_blocks == 16
    if transfer == "nixl":
        assert node.nixl_side_channel == "tcp://10.0.0.7:5601"
    else:
        assert node.store == "redis://10.0.0.5:6379" and node.nixl_side_channel is None
    assert placement(args).role_resources == {"encode": "vision_host"}
    assert node_counts(args) == {"prefill": 1, "decode": 1, "encode": 1}


def test_ray_without_encode_nodes_has_no_encode_template():
    args = _up("--ray", "auto", "--kv-transfer", "nixl")
    assert "encode" not in node_templates(args, Cluster(args)) and node_counts(args)["encode"] == 0


class _Registry:
    address = "tcp://10.0.0.1:7000"


def test_the_ray_controller_starts_an_encoder_node(monkeypatch):
    """start_node("encode") asks for an actor running the encode template, registered with the
    controller's registry, with the role's resource (the actor itself needs a Ray cluster)."""
    args = _up("--ray", "auto", "--kv-transfer", "nixl", "--encode-nodes", "1", "--ray-encode-resource", "vision_host")
    controller = RayController.__new__(RayController)  # no registry, admin server or Ray here
    controller.templates, controller.placement = node_templates(args, Cluster(args)), placement(args)
    controller.registry, controller.nodes, controller._lock = _Registry(), {}, threading.RLock()
    controller._next_index, controller.roles_namespace = {"prefill": 0, "decode": 0, "encode": 0}, "ns"
    started = []
    monkeypatch.setattr(controller, "_actor", lambda name, template, threads, gpus, resources, **kw:
                        started.append((name, template, resources)) or name)
    assert controller.start_node("encode") == "encode-0"
    name, template, resources = started[0]
    node = _parse(fill_template(template, "10.0.0.7", {"control": 5600, "side": 5601}))
    assert node.command == "encode" and node.registry == _Registry.address and resources == {"vision_host": 1}
    assert controller.owned_nodes() == {"encode-0": "encode"}
    assert isinstance(controller.placement, Placement)
