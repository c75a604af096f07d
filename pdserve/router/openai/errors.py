"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with a matching status.

Every failure the HTTP layer can see ends here, so clients (the official `openai` package
included) get a parseable body and never a bare 500 with a traceback.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.router.dispatch.backend import BackendError

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict"}

# Another API's error body for the paths under a prefix (the Anthropic Messages API's):
# (status, message, type, param, code) -> body. Registered with add_error_shape.
ErrorShape = Callable[[int, str, str, str | None, str | None], dict[str, Any]]


class APIError(Exception):
    """Raised by handlers to answer with an OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, declared in the OpenAPI document for every error status."""
    error: ErrorDetail


_ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a value out of range or not supported, a prompt "
         "longer than the context (validation errors are 400 here, never FastAPI's 422)",
    401: "Missing or wrong API key (--api-key; /health and /metrics with --protect-metrics)",
    404: "Not found: an unknown model, or /metrics on a backend that exports none",
    413: "Request body larger than --max-body-bytes",
    429: "More generation requests in flight than --max-queued-requests (with Retry-After)",
    500: "Internal error (a bug; the body never carries a traceback)",
    503: "No healthy node can serve the request (with Retry-After)",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: the error statuses it can answer, each with ErrorResponse."""
    return {status: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]}
            for status in statuses}


def drop_validation_422(doc: dict[str, Any]) -> dict[str, Any]:
    """FastAPI declares 422 on every route with a body; this app answers validation errors
    with 400 (OpenAI's status), so 422 and its schemas would be a promise never kept."""
    for operations in doc.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    return doc


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", NOT_FOUND, "model",
                    "model_not_found")


def backend_unavailable(exc: BaseException) -> APIError:
    # Retry-After: a lost node is replaced within seconds (failover, restarts), so say when.
    return APIError(503, f"Generation backend unavailable: {exc}", SERVER_ERROR, None,
                    "service_unavailable", {"Retry-After": "1"})


# A node's engine refuses a prompt longer than its own context (engine/engine.py). The router
# refuses those longer than its --max-model-len itself; a node's context can be shorter still
# (its KV cache holds fewer tokens), and that refusal is the client's 400 too, not a 503.
_NODE_TOO_LONG = re.compile(r"the prompt has (\d+) tokens; this model accepts at most (\d+)")


def nodes_context_exceeded(limit: int, prompt_tokens: int) -> APIError:
    """A prompt of `prompt_tokens` where the nodes' KV caches hold fewer than `limit` + 1 tokens:
    the router's refusal (app._Router.check_nodes_context) and the node's (as_api_error) alike."""
    return APIError(400, f"This model's maximum context length is {limit} tokens on the nodes serving it (their "
                    f"KV cache or attention window holds no more). However, your prompt has {prompt_tokens} tokens.",
                    code="context_length_exceeded")


def as_api_error(exc: BaseException) -> APIError:
    """Maps anything a generation can raise to the error a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, BackendError):
        too_long = _NODE_TOO_LONG.search(str(exc))
        if too_long is not None:
            return nodes_context_exceeded(int(too_long[2]) + 1, int(too_long[1]))
        return backend_unavailable(exc)
    # Internal bug: log the traceback here, show the client only that it failed.
    logger.error("internal error", exc_info=exc)
    return APIError(500, "Internal server error", SERVER_ERROR)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request", None
    # Our own validators' messages (value_error) say more than a failed union branch does.
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    if first.get("type") == "json_invalid":
        return "Request body is not valid JSON", None
    # loc is ("body", "field", ...); the OpenAI `param` is the field path without "body".
    # Union members also appear in loc ("str", "list[int]"); they are not field names.
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and p not in _UNION_TAGS
           and "[" not in str(p)]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{param or 'body'}: {msg}", param


def _log_refusal(request: Request, status: int, message: str) -> None:
    """Client errors at INFO (the default level): a client's failure can be traced in the log."""
    if status < 500:
        logger.info("%s %s -> %d: %s", request.method, request.url.path, status, message)


def _respond(request: Request, err: APIError) -> JSONResponse:
    """The error in the shape of the API the request's path belongs to (OpenAI's by default)."""
    shapes: dict[str, ErrorShape] = getattr(request.app.state, "error_shapes", {})
    path, root = request.scope["path"], request.scope.get("root_path", "")
    path = path[len(root):] if root and path.startswith(root) else path  # behind --root-path
    shape = next((f for prefix, f in shapes.items() if path.startswith(prefix)), None)
    body = shape(err.status, err.message, err.type, err.param, err.code) if shape else err.body()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    _log_refusal(request, exc.status, exc.message)
    return _respond(request, exc)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = _validation_message(exc)
    _log_refusal(request, 400, message)
    return _respond(request, APIError(400, message, INVALID_REQUEST, param))


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    _log_refusal(request, exc.status_code, str(exc.detail))
    kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
    return _respond(request, APIError(exc.status_code, str(exc.detail), kind,
                                      headers=getattr(exc, "headers", None)))


async def _on_backend_error(request: Request, exc: Exception) -> JSONResponse:
    return _respond(request, as_api_error(exc))


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    return _respond(request, as_api_error(exc))


def add_error_shape(app: FastAPI, prefix: str, shape: ErrorShape) -> None:
    """Errors of the routes under `prefix` answer in `shape` (its status stays the error's)."""
    app.state.error_shapes = {**getattr(app.state, "error_shapes", {}), prefix: shape}


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(BackendError, _on_backend_error)
    app.add_exception_handler(Exception, _on_unexpected)
