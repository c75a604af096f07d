"""Admission at the router's door, before any parsing: API key, body size, and a bound on the
generation requests in flight. Every refusal is an OpenAI-shaped error (Anthropic's under
/v1/messages): 401, 413, or 429 with Retry-After (the client may come back), so overload sheds
load instead of queueing without end. The key comes as a bearer token, or as Anthropic's x-api-key.

A plain ASGI middleware (not a FastAPI dependency) so a streamed response counts as in flight
until its last byte, and a refused request costs no JSON parsing.
"""
from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.router.anthropic.errors import anthropic_error
from pdserve.router.openai.errors import INVALID_REQUEST, SERVER_ERROR, APIError, error_body
from pdserve.router.routes.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUED_REQUESTS
from pdserve.router.routes.tenants import SCOPE_TENANT, parse_api_keys


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None = None, protect_metrics: bool = False,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS, metrics=None) -> None:
        self.app = app
        # key -> the tenant it names (None: none); see router/tenants.py
        self.api_keys = parse_api_keys(api_key)
        self.protect_metrics = protect_metrics
        self.max_body_bytes = max_body_bytes
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            return await _send_error(send, app_path(scope).startswith("/v1/messages"), *refusal)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        self.in_flight += 1
        try:
            await self.app(scope, self._limited(receive), send)
        finally:
            self.in_flight -= 1

    def _refusal(self, scope: Scope) -> tuple | None:
        headers = dict(scope.get("headers") or [])
        path = app_path(scope)
        protected = path.startswith(("/v1/", "/admin/")) or (self.protect_metrics and path in ("/metrics", "/health"))
        if self.api_keys and protected:
            # Anthropic's clients send the key as x-api-key; OpenAI's as a bearer token.
            key = headers.get(b"x-api-key")
            known, tenant = self._key_tenant(headers.get(b"authorization") or (b"Bearer " + key if key else b""))
            if not known:
                self._count("unauthorized")
                return 401, "Incorrect API key provided.", INVALID_REQUEST, "invalid_api_key", {}
            if tenant is not None:
                scope[SCOPE_TENANT] = tenant
        if scope["method"] != "POST":
            return None
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large()
        if self.in_flight >= self.max_queued_requests:
            self._count("queue_full")
            return (429, f"The server is at its limit of {self.max_queued_requests} requests in flight; "
                    "retry later.", SERVER_ERROR, "rate_limit_exceeded", {"retry-after": "1"})
        return None

    def _key_tenant(self, header: bytes) -> tuple[bool, str | None]:
        """(whether the bearer token is a known key, the tenant it names). Every key is compared,
        in constant time each, so the time taken does not say which key came close."""
        scheme, _, token = header.partition(b" ")
        token = token.strip()
        found, tenant = False, None
        for key, key_tenant in self.api_keys.items():
            if hmac.compare_digest(token, key) and scheme.lower() == b"bearer":
                found, tenant = True, key_tenant
        return found, tenant

    def _too_large(self) -> tuple:
        self._count("body_too_large")
        return (413, f"The request body is larger than {self.max_body_bytes} bytes.", INVALID_REQUEST,
                "request_too_large", {})

    def _limited(self, receive: Receive) -> Receive:
        """A chunked body has no Content-Length: count its bytes as they arrive."""
        seen = 0

        async def guarded() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:  # answered as 413 by the app's APIError handler
                status, text, type_, code, _ = self._too_large()
                raise APIError(status, text, type_, None, code)
            return message
        return guarded

    def _count(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(kind).inc()


def app_path(scope: Scope) -> str:
    """The request's path within the app (uvicorn's --root-path prefixes scope["path"] with it)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


async def _send_error(send: Send, anthropic: bool, status: int, message: str, type_: str, code: str,
                      headers: dict) -> None:
    """anthropic: the refusal of an Anthropic Messages route, in Anthropic's error shape."""
    shaped = anthropic_error(status, message) if anthropic else error_body(message, type_, None, code)
    body = json.dumps(shaped).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
