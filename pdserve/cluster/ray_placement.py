"""Gang placement of a tensor-parallel node on Ray: one placement group per node.

A node at TP N runs N ranks: its own process (rank 0) and N - 1 worker processes it forks. The
workers are not Ray tasks, so Ray cannot place them; they run on the node's machine because they
are its children. What Ray must do is reserve their share of that machine before the node starts,
all or nothing: a STRICT_PACK placement group with one bundle per rank ({"CPU": threads per
rank, "GPU": GPUs per rank}) is reserved atomically on a single machine, and the node's actor
runs in bundle 0. The other bundles stay reserved for the group while it lives, so no other
actor takes the cores (or GPUs) the workers compute on, and `ray status` / the placement group
table show one bundle per rank. When the machine dies, Ray reschedules the whole group on
another one and restarts the actor there (max_restarts).
"""
from __future__ import annotations

STRATEGY = "STRICT_PACK"


def rank_bundles(tp: int, threads_per_rank: int, gpus_per_rank: float,
                 role_resource: str | None = None) -> list[dict[str, float]]:
    """One bundle per rank. A role's custom resource is one unit per node, as at TP 1, so it
    goes in bundle 0, the one the node's actor runs in."""
    if tp < 2:
        raise ValueError(f"a placement group is for tensor-parallel nodes, not TP {tp}")
    bundle: dict[str, float] = {"CPU": float(threads_per_rank)}
    if gpus_per_rank:
        bundle["GPU"] = float(gpus_per_rank)
    bundles = [dict(bundle) for _ in range(tp)]
    if role_resource:
        bundles[0][role_resource] = 1.0
    return bundles


def actor_options_in_group(group, bundle: dict[str, float]) -> dict:
    """Ray actor options that run the node's actor in bundle 0 of `group`, using exactly that
    bundle's resources (an actor must fit in one bundle)."""
    # optional dependency: ray (the pdserve[ray] extra)
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    options = dict(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0),
                   scheduling_strategy=PlacementGroupSchedulingStrategy(
                       placement_group=group, placement_group_bundle_index=0,
                       # The node's own Ray calls (none today) must not eat the workers' bundles.
                       placement_group_capture_child_tasks=False))
    if custom:
        options["resources"] = custom
    return options


def create_node_group(name: str, bundles: list[dict[str, float]]):
    from ray.util.placement_group import placement_group  # optional dependency: ray (the pdserve[ray] extra)
    return placement_group(bundles, strategy=STRATEGY, name=name)


def remove_node_group(group) -> None:
    from ray.util.placement_group import remove_placement_group  # optional dependency: ray (the pdserve[ray] extra)
    remove_placement_group(group)
