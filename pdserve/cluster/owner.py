"""The one component that starts and stops node processes.

Locally that is the launcher (`pdserve up`); on Ray, the controller actor. Scaling, restarts and
role switches all go through the owner, so no two components ever fight over a node's process.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from pdserve.wire.messages import ROLES


def with_role(argv: list[str], role: str) -> list[str]:
    """A node's `pdserve ... ROLE ...` command line with its role subcommand (the first argument
    that names a role) replaced. Every node gets both roles' flags, so nothing else changes."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    at = next((i for i, arg in enumerate(argv) if arg in ROLES), None)
    if at is None:
        raise ValueError(f"no role subcommand in {argv!r}")
    return [*argv[:at], role, *argv[at + 1:]]


@runtime_checkable
class NodeOwner(Protocol):
    def start_node(self, role: str) -> str:
        """Start a node of `role` ("prefill" or "decode"); returns its node_id."""
        ...

    def stop_node(self, node_id: str) -> None:
        """Stop a node (SIGTERM, once it has drained)."""
        ...

    def set_role(self, node_id: str, role: str) -> None:
        """Record that a node switched roles in place, so a restart starts it in `role`."""
        ...

    def owned_nodes(self) -> dict[str, str]:
        """node_id -> role of every node this owner runs."""
        ...
