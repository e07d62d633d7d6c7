"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Route code raises ``OpenAIError`` (or a subclass); ``install_error_handlers`` maps it, pydantic
validation errors (400, not FastAPI's 422), ``ValueError`` from the engine (400),
``EngineDeadError`` (503), ``EngineStepError`` (500), ``RecursionError`` (400: a request nested too deeply
for some code that walks it) and unknown routes (404) to that body.
A body that is not JSON is a 400 that says where it stops parsing (line and column) or, when it was sent
with another Content-Type, that the content type is the problem (400 as vLLM and OpenAI answer, not
415). An overloaded engine is a 503 with a Retry-After header, a request past ``--request-timeout`` a 504.
"""

from __future__ import annotations

import email.message
import json
import logging
from http import HTTPStatus
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.request_limits import EngineOverloadedError, RequestTimeoutError
from engine.errors import EngineDeadError, EngineStepError

logger = logging.getLogger("chorus.server")


class OpenAIError(Exception):
    """An error to return to the client with ``status_code`` and an OpenAI error body."""

    status_code: int = HTTPStatus.BAD_REQUEST
    err_type: str = "BadRequestError"

    def __init__(self, message: str, param: Optional[str] = None, status_code: Optional[int] = None,
                 err_type: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers
        """Extra response headers (Retry-After on a 503)."""
        if status_code is not None:
            self.status_code = status_code
        if err_type is not None:
            self.err_type = err_type


class BadRequestError(OpenAIError):
    status_code = HTTPStatus.BAD_REQUEST
    err_type = "BadRequestError"


class NotFoundError(OpenAIError):
    status_code = HTTPStatus.NOT_FOUND
    err_type = "NotFoundError"


class UnauthorizedError(OpenAIError):
    status_code = HTTPStatus.UNAUTHORIZED
    err_type = "AuthenticationError"


class PayloadTooLargeError(OpenAIError):
    status_code = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    err_type = "RequestEntityTooLargeError"


class ServiceUnavailableError(OpenAIError):
    status_code = HTTPStatus.SERVICE_UNAVAILABLE
    err_type = "ServiceUnavailableError"


class RequestTimeoutHTTPError(OpenAIError):
    """408: the client did not send its request (headers and body) in time."""

    status_code = HTTPStatus.REQUEST_TIMEOUT
    err_type = "RequestTimeoutError"


class GatewayTimeoutError(OpenAIError):
    """504: the request ran past ``--request-timeout`` (the engine aborted it)."""

    status_code = HTTPStatus.GATEWAY_TIMEOUT
    err_type = "GatewayTimeoutError"


RETRY_AFTER_S = 5
"""Retry-After of an overload 503: clients (the OpenAI SDK among them) wait this long before a retry."""


def error_body(message: str, err_type: str, code: int, param: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": int(code)}}


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.err_type, err.status_code, err.param),
                        status_code=int(err.status_code), headers=err.headers)


def to_openai_error(exc: BaseException) -> OpenAIError:
    """Classify any exception raised while serving a request."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return ServiceUnavailableError(f"The engine is not available: {exc}")
    if isinstance(exc, EngineOverloadedError):
        return ServiceUnavailableError(str(exc), headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, RequestTimeoutError):
        return GatewayTimeoutError(str(exc))
    if isinstance(exc, EngineStepError):   # the engine logged the traceback
        return OpenAIError(str(exc), status_code=HTTPStatus.INTERNAL_SERVER_ERROR, err_type="InternalServerError")
    from lora.errors import LoRAAdapterNotFoundError
    if isinstance(exc, LoRAAdapterNotFoundError):
        return NotFoundError(str(exc), param="lora_path")
    if isinstance(exc, (ValueError, TypeError)):
        return BadRequestError(str(exc), param=_guess_param(str(exc)))
    if isinstance(exc, RecursionError):
        return BadRequestError("The request is nested too deeply to be processed; send lists and objects "
                               "(and templates) with fewer levels.")
    logger.exception("Internal error while serving a request.", exc_info=exc)
    return OpenAIError(f"Internal server error: {exc!r}", status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
                       err_type="InternalServerError")


def _guess_param(message: str) -> Optional[str]:
    """Engine ValueErrors start with the field name ("temperature must be ..."): report it as param."""
    head = message.split(" ", 1)[0].strip("`'\":,.")
    return head if head.isidentifier() and head.islower() and "_" in head or head in _KNOWN_PARAMS else None


_KNOWN_PARAMS = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "logprobs", "prompt",
                 "messages", "model", "max_tokens", "min_tokens", "echo"}


def format_validation_error(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    """pydantic errors -> one readable message and the first offending field (``ctx.param`` of an error
    raised before the fields are validated, else the error's first location)."""
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = ".".join(loc)
        named = (err.get("ctx") or {}).get("param")
        if param is None and (loc or isinstance(named, str)):
            param = named if isinstance(named, str) else loc[0]
        msg = err.get("msg", "invalid value")
        parts.append(f"{field}: {msg}" if field else msg)
    return "; ".join(parts) or "Invalid request body.", param


JSON_HINT = "send the body as a JSON object with 'Content-Type: application/json'"


def body_error(exc: RequestValidationError, content_type: Optional[str]) -> Optional[BadRequestError]:
    """A body that is not JSON at all (as opposed to JSON with a bad field): the content type, or where
    the JSON stops parsing (FastAPI reports only the offset); None when the body is JSON."""
    errors = exc.errors()
    if not _is_json_content_type(content_type) and any(tuple(e.get("loc", ()))[:1] == ("body",)
                                                        for e in errors):
        # FastAPI does not parse a body of another content type (nor one without: CSRF) as JSON.
        what = (f"Content-Type {content_type!r} is" if content_type
                else "A request body without Content-Type is")
        return BadRequestError(f"{what} not supported here; {JSON_HINT}.")
    for err in errors:
        loc = tuple(err.get("loc", ()))
        if err.get("type") == "json_invalid" and len(loc) == 2 and isinstance(loc[1], int):
            doc = exc.body.decode("utf-8", "replace") if isinstance(exc.body, bytes) else str(exc.body or "")
            msg = str((err.get("ctx") or {}).get("error", "invalid JSON"))
            where = json.JSONDecodeError(msg, doc, loc[1]) if loc[1] <= len(doc) else None
            place = f"line {where.lineno} column {where.colno} (char {loc[1]})" if where else f"char {loc[1]}"
            return BadRequestError(f"The request body is not valid JSON: {msg} at {place}; {JSON_HINT}.")
        if err.get("type") == "missing" and loc == ("body",):
            return BadRequestError(f"The request body is empty; {JSON_HINT}.")
    return None


def _is_json_content_type(value: Optional[str]) -> bool:
    """application/json or application/*+json (as FastAPI decides what to parse), any parameters."""
    if not value:
        return False
    message = email.message.Message()
    message["content-type"] = value
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json"
                                                                or subtype.endswith("+json"))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = body_error(exc, request.headers.get("content-type"))
        if err is None:
            message, param = format_validation_error(exc)
            err = BadRequestError(message, param=param)
        return error_response(err)

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(to_openai_error(exc))

    @app.exception_handler(EngineStepError)
    async def _step(_: Request, exc: EngineStepError) -> JSONResponse:
        return error_response(to_openai_error(exc))

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(to_openai_error(exc))

    async def _classified(_: Request, exc: Exception) -> JSONResponse:
        return error_response(to_openai_error(exc))

    for exc_type in (EngineOverloadedError, RequestTimeoutError, RecursionError):   # 503, 504, 400
        app.add_exception_handler(exc_type, _classified)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, RecursionError):   # FastAPI's json.loads of a body nested too deep
            return error_response(to_openai_error(exc.__cause__))
        phrase = HTTPStatus(exc.status_code).phrase.replace(" ", "") + "Error"
        return JSONResponse(error_body(str(exc.detail), phrase, exc.status_code),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))
