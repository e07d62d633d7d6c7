"""Anthropic's error shape, ``{"type": "error", "error": {"type": ..., "message": ...}}``, with the error type
mapped from the HTTP status (the one Anthropic's API and SDK pair with it), for every failure of
``/v1/messages``: the same classification as the OpenAI routes (``engine.server.errors.to_openai_error``:
a bad request 400, an unknown model 404, an overloaded engine 503 with Retry-After, a timeout 504, ...).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Optional

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from engine.server.errors import to_openai_error

ERROR_TYPES: dict[int, str] = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.INTERNAL_SERVER_ERROR: "api_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "overloaded_error",
    HTTPStatus.GATEWAY_TIMEOUT: "timeout_error",
    529: "overloaded_error",
}
"""HTTP status -> Anthropic error type; other 4xx are ``invalid_request_error``, other 5xx ``api_error``."""


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return ERROR_TYPES.get(int(status)) or ("invalid_request_error" if int(status) < 500 else "api_error")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type": <from status>, "message": message}}``."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def anthropic_error_response(status: int, message: str,
                             headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(anthropic_error_body(status, message), status_code=int(status), headers=headers)


def validation_message(exc: ValidationError) -> str:
    """A pydantic validation error as one line: ``field.path: reason; ...``."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{where}: {err.get('msg', 'invalid')}" if where else str(err.get("msg", "invalid")))
    return "; ".join(parts) or "The request body is not valid."


def classify(exc: BaseException) -> tuple[int, str, Optional[dict[str, str]]]:
    """(HTTP status, message, extra headers) of any exception raised while serving ``/v1/messages``."""
    if isinstance(exc, ValidationError):
        return HTTPStatus.BAD_REQUEST, validation_message(exc), None
    err = to_openai_error(exc)
    message = err.message
    if err.param and not message.startswith(err.param):
        message = f"{err.param}: {message}"
    return int(err.status_code), message, err.headers


def to_anthropic_error(exc: BaseException) -> JSONResponse:
    """Any exception raised while serving ``/v1/messages`` -> its Anthropic error response."""
    return anthropic_error_response(*classify(exc))


def from_openai_error(body: Any, status: int, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """An OpenAI error body (``{"error": {"message", "type", "param", "code"}}``) -> Anthropic's."""
    error = body.get("error") if isinstance(body, dict) else None
    message = str(error.get("message")) if isinstance(error, dict) else "The request failed."
    param = error.get("param") if isinstance(error, dict) else None
    if isinstance(param, str) and param and not message.startswith(param):
        message = f"{param}: {message}"
    return anthropic_error_response(status, message, headers)
