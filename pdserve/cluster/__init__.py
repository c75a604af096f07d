"""Cluster membership: the node registry, its messages, and the owner that starts and stops nodes."""
