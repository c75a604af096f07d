"""Speculative decoding: a proposer drafts k tokens per decoding request, one target forward
pass scores them inside the continuous batch, and the verifier keeps the longest prefix the
target itself would have drawn, plus one token (docs/speculative-decoding.md)."""
