"""The one component that starts and stops node processes.

Locally that is the launcher (`pdserve up`); on Ray, the controller actor. Scaling, restarts and
role switches all go through the owner, so no two components ever fight over a node's process.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class NodeOwner(Protocol):
    def start_node(self, role: str) -> str:
        """Start a node of `role` ("prefill" or "decode"); returns its node_id."""
        ...

    def stop_node(self, node_id: str) -> None:
        """Stop a node (SIGTERM, once it has drained)."""
        ...

    def owned_nodes(self) -> dict[str, str]:
        """node_id -> role of every node this owner runs."""
        ...
