"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Route code raises ``OpenAIError`` (or a subclass); ``install_error_handlers`` maps it, pydantic
validation errors (400, not FastAPI's 422), ``ValueError`` from the engine (400),
``EngineDeadError`` (503), ``EngineStepError`` (500) and unknown routes (404) to that body.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import EngineDeadError, EngineStepError

logger = logging.getLogger("chorus.server")


class OpenAIError(Exception):
    """An error to return to the client with ``status_code`` and an OpenAI error body."""

    status_code: int = HTTPStatus.BAD_REQUEST
    err_type: str = "BadRequestError"

    def __init__(self, message: str, param: Optional[str] = None, status_code: Optional[int] = None,
                 err_type: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
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


def error_body(message: str, err_type: str, code: int, param: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": int(code)}}


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.err_type, err.status_code, err.param),
                        status_code=int(err.status_code))


def to_openai_error(exc: BaseException) -> OpenAIError:
    """Classify any exception raised while serving a request."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return ServiceUnavailableError(f"The engine is not available: {exc}")
    if isinstance(exc, EngineStepError):   # the engine logged the traceback
        return OpenAIError(str(exc), status_code=HTTPStatus.INTERNAL_SERVER_ERROR, err_type="InternalServerError")
    from lora.errors import LoRAAdapterNotFoundError
    if isinstance(exc, LoRAAdapterNotFoundError):
        return NotFoundError(str(exc), param="lora_path")
    if isinstance(exc, (ValueError, TypeError)):
        return BadRequestError(str(exc), param=_guess_param(str(exc)))
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
    """pydantic errors -> one readable message and the first offending field."""
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        msg = err.get("msg", "invalid value")
        parts.append(f"{field}: {msg}" if field else msg)
    return "; ".join(parts) or "Invalid request body.", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = format_validation_error(exc)
        return error_response(BadRequestError(message, param=param))

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

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        phrase = HTTPStatus(exc.status_code).phrase.replace(" ", "") + "Error"
        return JSONResponse(error_body(str(exc.detail), phrase, exc.status_code),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))
