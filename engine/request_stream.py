"""The stream of one request's ``RequestOutput``s (``RequestStream``), the collector its outputs wait in
while its consumer lags, and ``owned_requests()``, which collects the streams opened in a context so that
the server can abort an HTTP exchange's requests when its client stops reading."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from typing import Callable, Iterator, Optional

from engine.outputs import RequestOutput


class OutputCollector:
    """A request's outputs its consumer has not taken yet: at most one ``RequestOutput``.

    While the consumer lags, DELTA outputs merge into the pending one (text and tokens appended),
    other kinds replace it, so a busy server sends fewer, larger chunks instead of queueing one
    per step (as vLLM V1's ``RequestOutputCollector``).
    """

    __slots__ = ("_delta", "_output", "_error", "_waiter")

    def __init__(self, delta: bool) -> None:
        self._delta = delta
        self._output: Optional[RequestOutput] = None
        self._error: Optional[BaseException] = None
        self._waiter: Optional[asyncio.Future] = None

    def put(self, output: RequestOutput) -> None:
        if self._output is None or not self._delta:
            self._output = output
        else:
            _merge_delta(self._output, output)
        self._wake()

    def put_error(self, error: BaseException) -> None:
        if self._error is None:   # the first error is the request's (a step's 500 before the engine's 503)
            self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> RequestOutput:
        """The pending output (outputs go before an error), waiting for one."""
        while self._output is None and self._error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._output is not None:
            output, self._output = self._output, None
            return output
        raise self._error


def _merge_delta(acc: RequestOutput, new: RequestOutput) -> None:
    """Append DELTA output ``new`` to the pending ``acc`` (per sample index)."""
    by_index = {c.index: c for c in acc.outputs}
    for c in new.outputs:
        a = by_index.get(c.index)
        if a is None:
            acc.outputs.append(c)
            acc.outputs.sort(key=lambda x: x.index)
            continue
        a.text += c.text
        a.token_ids = a.token_ids + c.token_ids
        if c.logprobs is not None:
            a.logprobs = (a.logprobs or []) + c.logprobs
        a.cumulative_logprob = c.cumulative_logprob
        a.finish_reason, a.stop_reason = c.finish_reason, c.stop_reason
    if acc.prompt_logprobs is None:
        acc.prompt_logprobs = new.prompt_logprobs
    acc.finished, acc.num_cached_tokens, acc.metrics = new.finished, new.num_cached_tokens, new.metrics


class RequestStream:
    """Async iterator over one request's ``RequestOutput``s; ends after the finished one.

    ``abort()`` (idempotent, synchronous) stops it and aborts the request in the engine unless it
    already finished. Cancelling a task blocked in ``__anext__`` aborts the request too.

    Args:
        request_id: the request's id.
        collector: where the request's outputs wait for this stream.
        on_close: called once when the stream closes, with whether the request must be aborted in the
            engine (it did not finish).
    """

    def __init__(self, request_id: str, collector: OutputCollector, on_close: Callable[[bool], None]) -> None:
        self._request_id = request_id
        self._collector = collector
        self._on_close = on_close
        self._finished = False
        self._closed = False

    @property
    def request_id(self) -> str:
        return self._request_id

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        try:
            item = await self._collector.get()
        except asyncio.CancelledError:  # the consumer went away
            self.abort()
            raise
        except BaseException:           # the engine died, or refused the request
            self._close(send_abort=False)
            raise
        if item.finished:
            self._finished = True
            self._close(send_abort=False)
        return item

    def abort(self) -> None:
        self._close(send_abort=not self._finished)

    def _close(self, send_abort: bool) -> None:
        if not self._closed:
            self._closed = True
            self._on_close(send_abort)


_REQUEST_SINK: contextvars.ContextVar[Optional[list[RequestStream]]] = contextvars.ContextVar(
    "chorus_request_sink", default=None)
"""The list ``owned_requests`` collects streams into, in the current context (None: not collecting)."""


@contextlib.contextmanager
def owned_requests() -> Iterator[list[RequestStream]]:
    """Collect every stream ``AsyncLLM.add_request`` opens inside this block, and in tasks started from it
    (they copy the context), so that their owner can abort them all: the server aborts the requests of an
    HTTP exchange whose client stopped reading."""
    streams: list[RequestStream] = []
    token = _REQUEST_SINK.set(streams)
    try:
        yield streams
    finally:
        _REQUEST_SINK.reset(token)


def hand_to_owner(stream: RequestStream) -> None:
    """Add ``stream`` to the ``owned_requests()`` block of the current context, if there is one."""
    sink = _REQUEST_SINK.get()
    if sink is not None:
        sink.append(stream)
