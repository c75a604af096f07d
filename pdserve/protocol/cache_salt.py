"""A tenant's cache salt: what keeps one tenant's prefix-cache blocks from ever serving another
(CVE-2025-46570: a shared prefix cache leaks through timing whether someone else sent a prompt).

A request's salt string is the client's `cache_salt` (vLLM's field), or the tenant its API key or
`x-tenant-id` header names, or both mixed (`tenant_cache_salt`). The string enters the first
block key's salt through pdserve.protocol.block_keys.request_salt, and every later key chains on
it. Torch-free: the router imports it.
"""
from __future__ import annotations

from typing import Any

MAX_CACHE_SALT_BYTES = 256
# Never in a client's cache_salt (nor in a tenant name): it marks the mixed tenant form, so no
# cache_salt a client can send equals another tenant's salt string.
TENANT_MARK = "\x00"


def cache_salt_error(value: Any, what: str = "cache_salt") -> str | None:
    """Why `value` is no valid cache salt (or tenant name), None when it is one."""
    if not isinstance(value, str):
        return f"{what} must be a string"
    if not value:
        return f"{what} must not be empty"
    if len(value.encode("utf-8", "surrogatepass")) > MAX_CACHE_SALT_BYTES:
        return f"{what} must be at most {MAX_CACHE_SALT_BYTES} bytes (UTF-8)"
    if TENANT_MARK in value:
        return f"{what} must not contain a NUL character"
    return None


def check_cache_salt(value: Any, what: str = "cache_salt") -> None:
    """ValueError when `value` is no valid cache salt (None is valid: no salt)."""
    if value is not None and (error := cache_salt_error(value, what)) is not None:
        raise ValueError(error)


def tenant_cache_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """One request's salt string from its tenant (API key or header) and its body's cache_salt.

    Both mix: a tenant's clients can partition their own cache further with cache_salt, but no
    cache_salt reaches another tenant's blocks (the tenant form starts with a NUL, which a
    client's cache_salt may not hold). Without a tenant it is the cache_salt as sent, so the
    same cache_salt keys the same blocks over HTTP and offline (LLM.generate).
    """
    if tenant is None:
        return cache_salt
    return f"{TENANT_MARK}tenant{TENANT_MARK}{tenant}{TENANT_MARK}{cache_salt or ''}"
