"""Speculative decoding: a proposer drafts k tokens per decoding request, one target forward
pass scores them inside the continuous batch, and the verifier keeps the longest prefix the
target itself would have drawn, plus one token (docs/speculative-decoding.md).

This package sits above the engine: it reaches the engine only through
pdserve.engine.speculation.SpeculationHost, and pdserve.assembly picks the proposer and attaches
the speculator."""
