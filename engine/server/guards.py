"""What a client may cost the server before and while a route runs: the API key (every route but
``OPEN_ROUTES``), the X-Request-Id header's characters, the body's size and arrival time, a response the
client does not read, and the request head's arrival time. Refusals on ``ANTHROPIC_ROUTES`` take
Anthropic's error shape, all others OpenAI's.

The ASGI guards are pure ASGI (streaming responses pass through untouched); the head deadline lives in
uvicorn's HTTP protocol, since no ASGI code runs before a request's head is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import sys
from typing import Any, AsyncIterator, Optional

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.request_stream import RequestStream, owned_requests
from engine.server.anthropic.errors import anthropic_error_response
from engine.server.errors import (BadRequestError, OpenAIError, PayloadTooLargeError,
                                  RequestTimeoutHTTPError, UnauthorizedError, error_body)
from engine.server.protocol import request_id_error

logger = logging.getLogger("chorus.server")

_DISCONNECT: Message = {"type": "http.disconnect"}


if sys.version_info >= (3, 11):
    _deadline = asyncio.timeout_at
else:  # pragma: no cover - Python 3.10
    @contextlib.asynccontextmanager
    async def _deadline(when: float) -> AsyncIterator[None]:
        """``asyncio.timeout_at`` of Python 3.11: TimeoutError when the block runs past loop time ``when``."""
        task, expired = asyncio.current_task(), False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        handle = asyncio.get_running_loop().call_at(when, expire)
        try:
            yield
        except asyncio.CancelledError:
            if expired:
                raise TimeoutError from None
            raise
        finally:
            handle.cancel()


ANTHROPIC_ROUTES = ("/v1/messages",)
"""The paths of Anthropic's API: their errors are ``{"type": "error", "error": {"type", "message"}}``."""


async def send_error(send: Send, err: OpenAIError, close: bool = False, path: str = "") -> None:
    """Answer with ``err``'s body (Anthropic's shape on ``ANTHROPIC_ROUTES``, else OpenAI's); ``close``: and
    ask for the connection to be closed (the request body was not read to its end)."""
    headers = {"connection": "close"} if close else None
    if path in ANTHROPIC_ROUTES:
        named = err.param and not err.message.startswith(err.param)
        message = f"{err.param}: {err.message}" if named else err.message
        resp = anthropic_error_response(int(err.status_code), message, headers)
    else:
        resp = JSONResponse(error_body(err.message, err.err_type, err.status_code, err.param),
                            status_code=int(err.status_code), headers=headers)
    await resp({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:  # pragma: no cover - JSONResponse never reads
    return _DISCONNECT


LINGER_S = 5.0
"""After refusing a body that is too large, how long the server goes on reading (and dropping) what the
client still sends before the response ends and the connection closes. Clients such as httpx and the
OpenAI SDK send the whole body before they read the reply, and a socket closed with unread bytes is reset
by the kernel, which loses the reply: this is nginx's lingering close."""
LINGER_IDLE_S = 1.0
"""The lingering read stops sooner when no byte arrives for this long (a client that waits for the reply)."""
LINGER_MAX_BYTES = 64 << 20
"""... and once this many bytes were dropped: past it, the connection closes (and may be reset)."""


async def refuse_body(send: Send, receive: Receive, err: OpenAIError, path: str = "") -> None:
    """Answer ``err`` with ``connection: close`` while the request body is still arriving, then read and
    drop the rest of it (bounded by ``LINGER_S``, ``LINGER_IDLE_S`` and ``LINGER_MAX_BYTES``) before the
    response ends, so the reply reaches a client that sends its whole body first. Nothing read is kept."""
    async def hold_the_end(message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            message = {**message, "more_body": True}   # the body is complete (Content-Length); the exchange is not
        await send(message)

    await send_error(hold_the_end, err, close=True, path=path)
    loop = asyncio.get_running_loop()
    end_s, num_dropped_bytes = loop.time() + LINGER_S, 0
    while num_dropped_bytes <= LINGER_MAX_BYTES:
        try:
            async with _deadline(min(end_s, loop.time() + LINGER_IDLE_S)):
                message = await receive()
        except TimeoutError:
            break
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
        num_dropped_bytes += len(message.get("body", b""))
    await send({"type": "http.response.body", "body": b"", "more_body": False})


OPEN_ROUTES = ("/health", "/metrics", "/version", "/ping")
"""The paths that answer without the API key (health checks and monitoring): every other path, unknown
ones included, is a 401 without the key (``Authorization: Bearer <key>``, or ``x-api-key: <key>`` as
Anthropic's SDK sends it) when a key is set. Unlike vLLM's ``--api-key`` (which guards /v1/* only),
/tokenize, /detokenize, /docs, /redoc and /openapi.json need the key too: they render templates and
reveal the model's and the server's surface."""


class APIKeyMiddleware:
    """401 without the key (``Authorization: Bearer <key>`` or ``x-api-key: <key>``) on every path but
    ``OPEN_ROUTES`` (exact paths), any method but OPTIONS (CORS preflight); an unknown path is a 401 too, so
    routes are not revealed. The key is compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = b"Bearer " + api_key.encode()
        """The ``Authorization`` header that opens the routes."""
        self.expected_x_api_key = api_key.encode()
        """The ``x-api-key`` header that opens them (Anthropic's SDK)."""

    def authorized(self, scope: Scope) -> bool:
        """The request carries the key in either header."""
        headers = dict(scope.get("headers") or [])
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
        x_api_key = hmac.compare_digest(headers.get(b"x-api-key", b""), self.expected_x_api_key)
        return bearer or x_api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("path", "") not in OPEN_ROUTES \
                and scope.get("method") != "OPTIONS":
            if not self.authorized(scope):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                await send_error(send, UnauthorizedError("Unauthorized: missing or invalid API key."),
                                 path=scope.get("path", ""))
                return
        await self.app(scope, receive, send)


class RequestIdHeaderMiddleware:
    """400 (``param: request_id``) for an ``X-Request-Id`` header that is not a valid request id
    (``protocol.REQUEST_ID_PATTERN``: it names the engine request and goes into log lines); the open routes
    (``OPEN_ROUTES``) ignore the header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path", "") not in OPEN_ROUTES:
            for name, value in scope.get("headers") or []:
                if name == b"x-request-id":
                    why = request_id_error(value.decode("latin-1"))
                    if why is not None:
                        await send_error(send, BadRequestError(f"X-Request-Id {why}", param="request_id"),
                                         path=scope.get("path", ""))
                        return
        await self.app(scope, receive, send)


class ClientGuardMiddleware:
    """What one HTTP exchange may cost, enforced while the app runs:

    - a body above ``max_body_bytes``: 413 at once by Content-Length, else as soon as the chunks read pass
      the limit (chunked transfer, multipart uploads): nothing beyond it is kept; what the client still
      sends is read and dropped for a bounded time (``refuse_body``) so that it gets the answer;
    - a body that has not fully arrived ``timeout_s`` after the request's head: 408 (a slowloris client);
    - a response the client does not read: a send that still waits for the socket's buffer to drain
      after ``timeout_s`` aborts every engine request the exchange opened (their KV blocks are freed) and
      ends the exchange; uvicorn then closes the connection.

    After a refusal the app sees a client disconnect, and what it still sends is dropped.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            if headers.get(b"expect", b"").lower() == b"100-continue":   # the client waits: no body comes
                await send_error(send, self.too_large(scope), close=True, path=scope.get("path", ""))
            else:
                await refuse_body(send, receive, self.too_large(scope), path=scope.get("path", ""))
            return
        exchange = _GuardedExchange(self, scope, receive, send)
        with owned_requests() as exchange.streams:
            try:
                await self.app(scope, exchange.receive, exchange.send)
            except Exception:
                if exchange.cut_short is None:
                    raise   # the app's own failure; after a refusal it only reacts to the "disconnect"

    def too_large(self, scope: Scope) -> PayloadTooLargeError:
        err = PayloadTooLargeError(f"Request body is larger than the limit of {self.max_body_bytes} bytes "
                                   "(--max-request-body-bytes).")
        if scope.get("path", "").startswith("/v1/audio/"):
            err = PayloadTooLargeError(err.message + " Audio files may be at most 25 MB.", param="file")
        return err


class _GuardedExchange:
    """One request/response under ``ClientGuardMiddleware``: the ``receive`` and ``send`` the app gets."""

    def __init__(self, guard: ClientGuardMiddleware, scope: Scope, receive: Receive, send: Send) -> None:
        self.guard = guard
        self.scope = scope
        self._receive = receive
        self._send = send
        self.body_deadline = asyncio.get_running_loop().time() + guard.timeout_s
        """Event-loop time by which the whole body must have arrived."""
        self.num_body_bytes = 0
        self.body_done = False
        """The last body chunk arrived (or the client left): ``receive`` passes through from now on."""
        self.response_started = False
        self.cut_short: Optional[str] = None
        """Why the exchange ended early (413, 408, a stalled reader); None while it runs normally."""
        self.streams: list[RequestStream] = []
        """The engine requests this exchange opened (``owned_requests``)."""

    async def receive(self) -> Message:
        if self.cut_short is not None:
            return _DISCONNECT
        if self.body_done:
            return await self._receive()
        try:
            async with _deadline(self.body_deadline):
                message = await self._receive()
        except TimeoutError:
            await self._refuse(RequestTimeoutHTTPError(
                f"The request body did not arrive within {self.guard.timeout_s:g} s "
                "(--slow-client-timeout); send it at once, or raise the timeout for slow links."))
            return _DISCONNECT
        if message["type"] != "http.request":
            self.body_done = True
            return message
        self.num_body_bytes += len(message.get("body", b""))
        if self.num_body_bytes > self.guard.max_body_bytes:
            await self._refuse(self.guard.too_large(self.scope))
            return _DISCONNECT
        self.body_done = not message.get("more_body", False)
        return message

    async def send(self, message: Message) -> None:
        if self.cut_short is not None:
            return
        if message["type"] == "http.response.start":
            self.response_started = True
        try:
            async with _deadline(asyncio.get_running_loop().time() + self.guard.timeout_s):
                await self._send(message)
        except TimeoutError:
            self.cut_short = "stalled reader"
            logger.warning("%s %s: the client has not read its response for %g s (--slow-client-timeout); "
                           "aborting its %d engine request(s) and closing the connection.",
                           self.scope.get("method"), self.scope.get("path"), self.guard.timeout_s,
                           len(self.streams))
            for stream in self.streams:
                stream.abort()

    async def _refuse(self, err: OpenAIError) -> None:
        """End the exchange with ``err`` (when no response has started), before the body was read."""
        self.cut_short = f"{int(err.status_code)}"
        if self.response_started:
            return
        self.response_started = True
        path = self.scope.get("path", "")
        try:
            if isinstance(err, PayloadTooLargeError):   # the client is still sending: drop the rest first
                async with _deadline(asyncio.get_running_loop().time() + self.guard.timeout_s + LINGER_S):
                    await refuse_body(self._send, self._receive, err, path=path)
            else:
                async with _deadline(asyncio.get_running_loop().time() + self.guard.timeout_s):
                    await send_error(self._send, err, close=True, path=path)
        except TimeoutError:
            pass   # the client reads nothing either; uvicorn closes the connection when the app returns


_HEAD_TIMEOUT_BODY = (b'{"error": {"message": "The request head did not arrive in time '
                      b'(--slow-client-timeout).", "type": "RequestTimeoutError", "param": null, '
                      b'"code": 408}}')
_HEAD_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                          b"connection: close\r\ncontent-length: " + str(len(_HEAD_TIMEOUT_BODY)).encode()
                          + b"\r\n\r\n" + _HEAD_TIMEOUT_BODY)


def head_deadline_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol (the one ``http="auto"`` picks: httptools, else h11) with a deadline for
    each request head: a connection that has not sent a complete head ``timeout_s`` after it opened, or
    after its previous response, gets a 408 and is closed. uvicorn alone closes only idle keep-alive
    connections, and a client that trickles header bytes resets that timer."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeadDeadlineProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_deadline: Optional[asyncio.TimerHandle] = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_deadline()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            self._head_deadline = self.loop.call_later(timeout_s, self._head_deadline_passed)

        def _head_deadline_passed(self) -> None:
            self._head_deadline = None
            if self.cycle is not None and not self.cycle.response_complete:
                return   # a request is being served (its body has the ASGI guard's deadline)
            if not self.transport.is_closing():
                self.transport.write(_HEAD_TIMEOUT_RESPONSE)
                self.transport.close()

    return HeadDeadlineProtocol
