"""`pdserve up --ray` command lines, without a Ray cluster: the node and router arguments each
actor fills in on its own machine parse as `pdserve prefill|decode|router` and bind and advertise
that machine's address; flags that cannot work across machines are refused before connecting."""
from __future__ import annotations

import json

import pytest

from pdserve.cluster.ray_actors import fill_template, template_ports
from pdserve.entrypoints.cli import build_parser
from pdserve.entrypoints.launcher import Cluster
from pdserve.entrypoints.ray_launch import node_templates, placement


def _up(*flags: str):
    return build_parser().parse_args(["up", "--ray", "auto", "--model", "builtin:tiny", *flags])


def test_each_machine_binds_and_advertises_its_own_address():
    args = _up("--kv-transfer", "nixl", "--store", "redis://10.0.0.5:6379", "--threads-per-node", "3",
               "--api-key", "sekret", "--routers", "2", "--port", "9000")
    templates = node_templates(args, Cluster(args))
    for role in ("prefill", "decode"):
        template = [a.replace("{node_id}", f"{role}-4") for a in templates[role]]
        assert template_ports(template) == ["control", "side"]
        argv = fill_template(template, "10.0.0.7", {"control": 5600, "side": 5601})
        node = build_parser().parse_args(argv)
        assert node.command == role and node.node_id == f"{role}-4"
        assert node.bind == "tcp://10.0.0.7:5600" and node.advertise_host == "10.0.0.7"
        assert node.nixl_side_channel == "tcp://10.0.0.7:5601" and node.store == "redis://10.0.0.5:6379"
    router_args = [a.replace("{router_port}", "9001") for a in templates["router"]]
    router = build_parser().parse_args(fill_template(router_args, "10.0.0.6", {}))
    assert (router.command, router.host, router.port) == ("router", "10.0.0.6", 9001)
    assert "sekret" not in " ".join(router_args), "the API key must not be on a command line"
    p = placement(args)
    assert p.threads_per_node == 3 and p.router_env == {"PDSERVE_API_KEY": "sekret"}


@pytest.mark.parametrize("flags, message", [
    (("--kv-transfer", "store"), "every machine reaches"),
    (("--kv-transfer", "store", "--store", "direct+redis://"), "every machine reaches"),
    (("--kv-transfer", "nixl", "--curve"), "--curve"),
    # A mixed pool (local `pdserve up` only): one template and one placement shape per role on Ray.
    (("--kv-transfer", "nixl", "--decode-tp", "1,2"), "--decode-tp 1,2"),
    (("--kv-transfer", "nixl", "--speculative-config", '[{"method": "ngram", "num_speculative_tokens": 2}, null]'),
     "every decode node has the same"),
])
def test_flags_that_cannot_span_machines_are_refused(flags, message):
    args = _up(*flags)
    with pytest.raises(ValueError, match=message):
        node_templates(args, Cluster(args))


def test_each_role_gets_its_tensor_parallel_size_and_the_cpus_of_all_its_ranks():
    args = _up("--kv-transfer", "nixl", "--threads-per-node", "2", "--decode-tp", "2")
    templates = node_templates(args, Cluster(args))
    fill = {"control": 5600, "side": 5601}
    parse = [build_parser().parse_args(fill_template([a.replace("{node_id}", f"{r}-0") for a in templates[r]],
                                                     "10.0.0.7", fill)) for r in ("prefill", "decode")]
    assert [n.tensor_parallel_size for n in parse] == [1, 2]
    assert placement(args).role_tp == {"prefill": 1, "decode": 2}


def test_a_tp_node_is_one_strict_pack_group_with_a_bundle_per_rank():
    """What `pdserve up --ray --decode-tp 2` reserves for each decode node: the group Ray places
    on one machine, all bundles or none, and the node's actor in bundle 0."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from pdserve.cluster.ray_placement import STRATEGY, actor_options_in_group, rank_bundles
    assert STRATEGY == "STRICT_PACK"
    args = _up("--kv-transfer", "nixl", "--threads-per-node", "2", "--decode-tp", "2",
               "--ray-gpus-per-node", "1", "--ray-decode-resource", "decode_host")
    p = placement(args)
    bundles = rank_bundles(p.role_tp["decode"], p.threads_per_node, p.gpus_per_node, p.role_resources["decode"])
    assert bundles == [{"CPU": 2.0, "GPU": 1.0, "decode_host": 1.0}, {"CPU": 2.0, "GPU": 1.0}]
    assert rank_bundles(3, 1, 0.0) == [{"CPU": 1.0}] * 3  # CPU machines: no GPU in the bundles
    with pytest.raises(ValueError, match="TP 1"):
        rank_bundles(1, 2, 0.0)
    group = object()  # stands for the ray PlacementGroup, which needs a running cluster
    options = actor_options_in_group(group, bundles[0])
    assert (options["num_cpus"], options["num_gpus"], options["resources"]) == (2.0, 1.0, {"decode_host": 1.0})
    strategy = options["scheduling_strategy"]
    assert isinstance(strategy, PlacementGroupSchedulingStrategy)
    assert strategy.placement_group is group and strategy.placement_group_bundle_index == 0
    assert strategy.placement_group_capture_child_tasks is False


def test_decode_nodes_get_the_speculative_config():
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    for value in (spec, f"[{spec}, {spec}]"):  # one for all, or a list of the same one
        args = _up("--kv-transfer", "nixl", "--speculative-config", value)
        templates = node_templates(args, Cluster(args))
        fill = {"control": 5600, "side": 5601}
        nodes = [build_parser().parse_args(fill_template([a.replace("{node_id}", f"{r}-0") for a in templates[r]],
                                                         "10.0.0.7", fill)) for r in ("prefill", "decode")]
        assert not hasattr(nodes[0], "speculative_config")  # prefill nodes take none
        assert json.loads(nodes[1].speculative_config) == json.loads(spec)
