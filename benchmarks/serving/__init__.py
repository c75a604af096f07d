"""Served benchmarks: a `pdserve up` cluster (or the router alone) under load over HTTP."""
