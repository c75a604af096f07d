"""Anthropic's error shape: {"type": "error", "error": {"type", "message"}}, its type named by
the status as Anthropic names them (a 400 is an invalid_request_error, a 503 an overloaded_error).
The OpenAI error's param, when it has one, leads the message, so a client still learns the field."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from pdserve.router.openai.errors import error_responses

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
          529: "overloaded_error"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error(status: int, message: str, _type: str = "", param: str | None = None,
                    _code: str | None = None) -> dict[str, Any]:
    """An error body (openai/errors.py's ErrorShape): the param leads the message unless it does already."""
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error shape, declared in the OpenAPI document for the Messages routes' errors."""
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


def anthropic_error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A Messages route's `responses=`: the error statuses it can answer, in Anthropic's shape."""
    return {status: {**declared, "model": AnthropicErrorResponse}
            for status, declared in error_responses(*statuses).items()}
