"""Requests to nodes: the node pool and its sockets, the prefill, decode and embedding paths
with their failover, drains, LoRA adapters on the nodes, metrics and the health report."""
