"""``POST /v1/messages``: a Messages request, translated, served by the chat-completions backend, and its
reply (or stream, or error) translated back.

The backend is a callable ``(chat_request_dict, raw_request) -> reply``; the server's is::

    async def backend(body, raw_request):
        return await serving_chat.create_chat_completion(ChatCompletionRequest.model_validate(body),
                                                         raw_request)

A reply may be a ``StreamingResponse`` of OpenAI SSE text (its body is replaced by Anthropic's events,
so the response object, and what it releases when it ends, stays the backend's), a ``JSONResponse`` (a
completion, or an OpenAI error body when its status is 4xx/5xx), a completion dict, an async iterable of
chunk dicts, or another ``Response`` (returned as it is: a 499 for a client that left). Every error,
raised or returned, reaches the client in Anthropic's shape (``errors``); one raised mid-stream
becomes an ``error`` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.server.anthropic.errors import (
    anthropic_error_body,
    anthropic_error_response,
    classify,
    from_openai_error,
    to_anthropic_error,
)
from engine.server.anthropic.protocol import MessagesRequest
from engine.server.anthropic.stream import anthropic_events, chunks_from_sse, sse
from engine.server.anthropic.translate import to_anthropic_message, to_chat_request

ChatReply = Union[Response, dict[str, Any], AsyncIterable[dict[str, Any]]]
ChatBackend = Callable[[dict[str, Any], Request], Awaitable[ChatReply]]
"""Serves a chat-completion request body (see the module doc for what it may return)."""


class AnthropicMessages:
    """The ``/v1/messages`` handler over a chat-completions backend."""

    def __init__(self, backend: ChatBackend) -> None:
        self.backend = backend
        """Serves the translated chat-completion requests."""

    async def create_message(self, raw_request: Request) -> Response:
        """Serve one ``POST /v1/messages``."""
        try:
            body = await raw_request.body()
            try:
                data = json.loads(body or b"null")
            except ValueError as e:
                return anthropic_error_response(HTTPStatus.BAD_REQUEST,
                                                f"The request body is not valid JSON: {e}.")
            if not isinstance(data, dict):
                return anthropic_error_response(
                    HTTPStatus.BAD_REQUEST, "The request body must be a JSON object (a Messages request).")
            req = MessagesRequest.model_validate(data)
            reply = await self.backend(to_chat_request(req), raw_request)
        except Exception as e:  # noqa: BLE001 - every failure answers in Anthropic's shape
            return to_anthropic_error(e)
        return self._reply(req, reply)

    def _reply(self, req: MessagesRequest, reply: ChatReply) -> Response:
        if isinstance(reply, StreamingResponse):
            reply.body_iterator = self._events(req, chunks_from_sse(reply.body_iterator))
            return reply
        if isinstance(reply, JSONResponse):
            data = json.loads(bytes(reply.body))
            headers = {k: v for k, v in reply.headers.items() if k.lower() == "retry-after"}
            if reply.status_code >= 400:
                return from_openai_error(data, reply.status_code, headers or None)
            reply = data
        if isinstance(reply, dict):
            message = to_anthropic_message(reply, req.stop_sequences)
            return JSONResponse(message.model_dump(mode="json"))
        if isinstance(reply, Response):
            return reply
        return StreamingResponse(self._events(req, reply), media_type="text/event-stream")

    async def _events(self, req: MessagesRequest,
                      chunks: AsyncIterable[dict[str, Any]]) -> AsyncIterator[str]:
        try:
            async for event in anthropic_events(chunks, model=req.model, stop_sequences=req.stop_sequences):
                yield event
        except Exception as e:  # noqa: BLE001 - reported in-band, as Anthropic's API does
            status, message, _ = classify(e)
            yield sse("error", anthropic_error_body(status, message))
