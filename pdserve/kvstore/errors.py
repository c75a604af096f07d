"""Errors raised by KV store backends."""
from __future__ import annotations


class KVStoreError(RuntimeError):
    """The store could not be reached or answered wrongly (connection refused, timeout, protocol
    error). Callers treat it as "nothing found" and fall back to recomputing; it never means a
    block was silently corrupted, since corrupt blocks just end the loaded run."""
