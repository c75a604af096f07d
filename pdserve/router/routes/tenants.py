"""Which tenant a request belongs to, and the salt string that keeps its KV blocks its own.

A tenant comes from the API key (`--api-key KEY:TENANT`, several keys separated by commas) or,
when the key names none, from the `x-tenant-id` header (as Dynamo takes it; meant for a trusted
gateway in front of the router, which sets it). The body's `cache_salt` (vLLM's field) mixes
with the tenant: see pdserve.protocol.cache_salt.tenant_cache_salt. The request's KV scope
(its salt and adapter) is router.placement.keys.KVScope.
"""
from __future__ import annotations

from fastapi import Request

from pdserve.protocol.cache_salt import cache_salt_error, tenant_cache_salt
from pdserve.router.openai.errors import bad_request

TENANT_HEADER = "x-tenant-id"
SCOPE_TENANT = "pdserve.tenant"  # set in the ASGI scope by AdmissionMiddleware from the API key


def parse_api_keys(spec: str | None) -> dict[bytes, str | None]:
    """`KEY[:TENANT][,KEY[:TENANT]...]` as {key: tenant or None}; ValueError when malformed.
    A key that itself holds ':' must name a tenant (the last ':' splits them)."""
    keys: dict[bytes, str | None] = {}
    for number, entry in enumerate((spec or "").split(","), 1):
        entry = entry.strip()
        if not entry:
            continue
        key, _, tenant = entry.rpartition(":") if ":" in entry else (entry, "", None)
        error = "an empty key" if not key else None if tenant is None else cache_salt_error(tenant, "its tenant")
        if error is not None:
            # (The entry itself is not quoted: it holds a secret.)
            raise ValueError(f"--api-key entry {number}: {error} (entries are KEY or KEY:TENANT)")
        keys[key.encode()] = tenant
    return keys


def request_tenant(request: Request) -> str | None:
    """The request's tenant: its API key's, else its x-tenant-id header's (400 when malformed)."""
    tenant = request.scope.get(SCOPE_TENANT)
    if tenant is not None:
        return tenant  # the key decides: a header cannot move a keyed client into another tenant
    header = request.headers.get(TENANT_HEADER)
    if header is None:
        return None
    error = cache_salt_error(header, TENANT_HEADER)
    if error is not None:
        raise bad_request(error, TENANT_HEADER)
    return header


def request_cache_salt(request: Request, cache_salt: str | None) -> str | None:
    """The salt string the request's block keys are salted with (None: shared as before)."""
    return tenant_cache_salt(request_tenant(request), cache_salt)
