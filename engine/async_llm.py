"""``AsyncLLM``: the asyncio client of an ``EngineCore``; ``generate()`` streams ``RequestOutput``s.

The core runs its loop in a thread of this process or in a process of its own; which one is the
transport's business (``engine/core_transport.py``) and nothing below depends on it:

    event loop (this object)                                  engine core (its loop)
    ------------------------                                  ----------------------
    add_request: processor (validate, tokenize, n)  -- AddRequest ------------->  scheduler
        (prompts with multi_modal_data: in the media thread pool)
        ValueError -> the caller (400), nothing sent
    stream.abort() / disconnect                     -- AbortRequests ---------->  frees blocks
    _on_step (one call_soon_threadsafe per step)   <-- EngineCoreOutputs (ids) --  step()
        output processor: detokenize, stop strings  -- AbortRequests (stopped) ->
        RequestOutput -> that request's collector (DELTA outputs merge while its consumer lags)
    call_engine("add_lora", ...)                    -- CallMethod / CallResult -

Prompts with images are processed (downloads, decoding, resizing, hashing) by a thread pool of
``MultiModalConfig.mm_processor_workers`` threads, so a burst of images never stalls the event loop
(streams, other requests); text prompts are processed inline as before, with no hop.

``RequestLimits`` (the server's ``--max-queued-requests`` and ``--request-timeout``) bound how many
requests may be in flight (beyond that ``EngineOverloadedError``, before anything is tokenized) and how
long one may live (a timer per request aborts it in the engine: ``RequestTimeoutError``).
``owned_requests()`` collects the streams opened in a context, so the server can abort an HTTP
exchange's requests when its client stops reading.

Commands are FIFO, so an abort always lands after its add. When the core dies (an exception
escaped a step, a fault injected by a test, a killed process) every in-flight stream and call
gets ``EngineDeadError`` and new requests are refused with it (503 and a failed ``/health``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator, Optional, Protocol

from engine.core_messages import (CALLABLE_METHODS, AbortRequests, AddRequest, CallMethod, CallResult,
                                  CoreMessage, EngineCoreOutputs, EngineDead, InjectFault)
from engine.core_transport import EngineTransport, ProcessTransport, ThreadTransport
from engine.engine_core import freeze_gc_heap
from engine.errors import EngineDeadError
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput, SchedulerStats
from engine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from lora.request import LoRARequest

logger = logging.getLogger("chorus.async_llm")


class EngineOverloadedError(RuntimeError):
    """More requests are in flight than ``RequestLimits`` allows; nothing was sent (HTTP 503 with
    Retry-After: the client should retry later)."""


class RequestTimeoutError(TimeoutError):
    """The request ran past ``RequestLimits.request_timeout_s``: it was aborted in the engine (its KV blocks
    are free) and its stream ends with this error (HTTP 504; streams: an in-band error event)."""


@dataclass
class RequestLimits:
    """How many requests may wait and how long one may live (``chorus serve --max-queued-requests``,
    ``--request-timeout``). The defaults limit nothing (offline use and tests)."""

    max_queued_requests: Optional[int] = None
    """Requests in flight beyond the engine's ``max_num_seqs`` (those cannot all be running: they wait)
    that may be added; one more is refused with ``EngineOverloadedError`` before it is tokenized. An ``n > 1``
    request or a transcription window counts once. None: no limit."""
    request_timeout_s: Optional[float] = None
    """Seconds from a request's arrival after which it is aborted (``RequestTimeoutError``). None: never."""


_REQUEST_SINK: contextvars.ContextVar[Optional[list["RequestStream"]]] = contextvars.ContextVar(
    "chorus_request_sink", default=None)
"""The list ``owned_requests`` collects streams into, in the current context (None: not collecting)."""


@contextlib.contextmanager
def owned_requests() -> Iterator[list["RequestStream"]]:
    """Collect every stream ``AsyncLLM.add_request`` opens inside this block, and in tasks started from it
    (they copy the context), so that their owner can abort them all: the server aborts the requests of an
    HTTP exchange whose client stopped reading."""
    streams: list[RequestStream] = []
    token = _REQUEST_SINK.set(streams)
    try:
        yield streams
    finally:
        _REQUEST_SINK.reset(token)


class StatLogger(Protocol):
    """What the client reports per step and per finished request; ``server/metrics.py`` implements it."""

    def on_step(self, num_prompt_tokens: int, num_generation_tokens: int, ttfts_s: list[float],
                itls_s: list[float]) -> None:
        """Prompt tokens of requests that got their first output, tokens generated, and the
        time-to-first-token / inter-token gaps observed in one step."""

    def on_finished(self, finish_reason: Optional[str], num_prompt_tokens: int, num_generation_tokens: int,
                    e2e_s: float, ttft_s: Optional[float], params: SamplingParams) -> None:
        ...


@dataclass
class _RequestState:
    """Event-loop side bookkeeping of one in-flight request."""

    request_id: str
    """The user's request id (the parent of its ``n`` sequences)."""
    params: SamplingParams
    """As the processor resolved them (max_tokens filled in)."""
    collector: "_OutputCollector"
    """Outputs not yet taken by the stream's consumer."""
    arrival_s: float
    """time.monotonic() when the request was added."""
    num_prompt_tokens: int
    """Prompt length in tokens (counted once, at the first token)."""
    first_token_s: Optional[float] = None
    """time.monotonic() of the first output with tokens."""
    last_token_s: Optional[float] = None
    """time.monotonic() of the latest output with tokens (inter-token gaps)."""
    num_tokens_by_index: dict[int, int] = field(default_factory=dict)
    """Sample index -> generated tokens seen so far (counters; works for every output kind)."""
    finished: bool = False
    """The stream delivered the finished output."""
    timeout_handle: Optional[asyncio.TimerHandle] = None
    """Fires ``RequestLimits.request_timeout_s`` after arrival (None: no timeout); cancelled on release."""

    @property
    def num_generation_tokens(self) -> int:
        return sum(self.num_tokens_by_index.values())


class _OutputCollector:
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


class AsyncLLM:
    """Async client of an engine core: ``generate()`` streams ``RequestOutput``s per request.

    Args:
        transport: a started-or-not ``EngineTransport`` (``ThreadTransport`` or
            ``ProcessTransport``); owned by this object from now on.
        log_requests: log each request's id, prompt head and params at INFO.
        stat_loggers: receivers of per-step token counts and timings (see ``StatLogger``).
    """

    def __init__(self, transport: EngineTransport, log_requests: bool = True,
                 stat_loggers: Optional[list[StatLogger]] = None) -> None:
        self._transport = transport
        facts = transport.facts
        self.tokenizer = facts.tokenizer
        self.model_name: str = facts.model_name
        self.max_model_len: int = facts.max_model_len
        self.engine_config = facts.engine_config
        self.processor = facts.processor
        """Validates and tokenizes requests here, off the engine loop."""
        self.default_sampling_params: dict = facts.default_sampling_params
        self.lora_enabled: bool = facts.lora_enabled
        self.log_requests = log_requests
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.output_processor = OutputProcessor(self.tokenizer)
        self._states: dict[str, _RequestState] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._request_counter = itertools.count()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._dead_error: Optional[EngineDeadError] = None
        self._dead_lock = threading.Lock()
        self._stats = SchedulerStats()
        self._media_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.limits = RequestLimits()
        """Queue bound and request timeout; the server sets them from its flags."""
        """Processes prompts with ``multi_modal_data`` off the event loop; made on first use."""
        freeze_gc_heap()   # the tokenizer, processor and imports stay out of GC passes
        transport.start(self._on_message)

    @classmethod
    def from_engine_args(cls, log_requests: bool = True, engine_process: bool = False,
                         **engine_kwargs: Any) -> "AsyncLLM":
        """Build the engine core: in a process of its own with ``engine_process``, else in the thread of
        this process that then runs its loop (``ThreadTransport``)."""
        if engine_process:
            return cls(ProcessTransport(engine_kwargs), log_requests=log_requests)
        from engine.arg_utils import EngineArgs
        from engine.engine_core import EngineCore
        args = EngineArgs.from_kwargs(**engine_kwargs)         # bad arguments fail here, in the caller
        return cls(ThreadTransport(lambda: EngineCore.from_engine_args(args)), log_requests=log_requests)

    # ------------------------------------------------------------------------------------
    # Engine facts and health (safe from any thread)
    # ------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None, continue_final_message: bool = False,
                            **kwargs) -> str:
        return self.processor.apply_chat_template(messages, add_generation_prompt, chat_template,
                                                  continue_final_message, **kwargs)

    @property
    def is_running(self) -> bool:
        return self._dead_error is None and self._transport.is_alive()

    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    @property
    def dead_error(self) -> Optional[EngineDeadError]:
        return self._dead_error

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine loop is not running."""
        if self._dead_error is not None:
            raise self._dead_error
        if not self._transport.is_alive():
            raise EngineDeadError("The engine loop is not running.")

    def get_stats(self) -> SchedulerStats:
        """The scheduler snapshot sent with the engine's latest step (or idle command drain)."""
        return self._stats

    @property
    def num_tracked_requests(self) -> int:
        """Requests this client still tracks (added, stream not yet closed): 0 when idle."""
        return len(self._states)

    def next_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._request_counter)}"

    # ------------------------------------------------------------------------------------
    # Event-loop API
    # ------------------------------------------------------------------------------------
    async def add_request(self, prompt: Any, sampling_params: SamplingParams, request_id: str,
                          lora_request: Optional["LoRARequest"] = None,
                          priority: int = 0) -> "RequestStream":
        """Validate, tokenize and submit one request.

        Raises:
            ValueError: a bad prompt or bad params (nothing reaches the engine).
            EngineDeadError: the engine loop is dead.

        The caller must iterate the returned stream to its end or call ``stream.abort()``. A
        request the engine core itself refuses ends its stream with that error.
        """
        loop = self._bind_loop()
        self._check_can_add(request_id)
        arrival_s, arrival_time = time.monotonic(), time.time()
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            # Downloads, decoding and preprocessing take milliseconds to seconds: not on the loop.
            text, children = await loop.run_in_executor(
                self._media_executor(), self.processor.process, request_id, prompt, sampling_params,
                lora_request, priority, arrival_time)
            self._check_can_add(request_id)   # the engine died, or the id got taken, meanwhile
        else:
            text, children = self.processor.process(request_id, prompt, sampling_params, lora_request,
                                                    priority, arrival_time)
        params = children[0].sampling_params
        collector = _OutputCollector(delta=params.output_kind == RequestOutputKind.DELTA)
        state = _RequestState(request_id, params, collector, arrival_s=arrival_s,
                              num_prompt_tokens=len(children[0].prompt_token_ids))
        self._states[request_id] = state
        timeout_s = self.limits.request_timeout_s
        if timeout_s is not None:
            state.timeout_handle = loop.call_later(max(0.0, arrival_s + timeout_s - time.monotonic()),
                                                   self._on_request_timeout, state, timeout_s)
        self.output_processor.add_request(request_id, children, text)
        self._transport.send(AddRequest(request_id, children))
        if self.log_requests:
            logger.info("Added request %s: prompt=%s, params=%s, lora=%s", request_id, _short(prompt),
                        sampling_params, getattr(lora_request, "lora_name", None))
        stream = RequestStream(self, state)
        sink = _REQUEST_SINK.get()
        if sink is not None:
            sink.append(stream)
        return stream

    def _check_can_add(self, request_id: str) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        max_queued = self.limits.max_queued_requests
        if max_queued is not None:
            max_running = self.engine_config.scheduler_config.max_num_seqs
            if len(self._states) >= max_running + max_queued:
                raise EngineOverloadedError(
                    f"The server is overloaded: {len(self._states)} requests are in flight ({max_running} "
                    f"run at once, {max_queued} may wait: --max-queued-requests); retry later.")

    def _media_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._media_pool is None:
            workers = self.engine_config.mm_config.mm_processor_workers
            self._media_pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                                     thread_name_prefix="chorus-media")
        return self._media_pool

    async def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str,
                       lora_request: Optional["LoRARequest"] = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its ``RequestOutput``s until it finishes.

        Raises what ``add_request`` raises, and ``EngineDeadError`` if the engine dies meanwhile.
        Cancelling the consumer (client disconnect) or closing the generator aborts the request.
        """
        stream = await self.add_request(prompt, sampling_params, request_id, lora_request, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests by id; their streams end (the last output has finish_reason 'abort')."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        outputs, child_ids = self.output_processor.abort_requests(ids)
        if child_ids and self._dead_error is None:
            self._transport.send(AbortRequests(child_ids))
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is not None:
                state.collector.put(out)

    async def call_engine(self, method: str, *args: Any) -> Any:
        """``EngineCore.<method>(*args)`` between steps (``add_lora``, ``remove_lora``,
        ``list_loras``, ``reset_prefix_cache``, ``get_stats``: ``CALLABLE_METHODS``)."""
        if method not in CALLABLE_METHODS:
            raise AttributeError(f"engine method {method!r} cannot be called by name; use one of "
                                 f"{CALLABLE_METHODS}.")
        loop = self._bind_loop()
        if self._dead_error is not None:
            raise self._dead_error
        call_id = next(self._call_ids)
        future = self._calls[call_id] = loop.create_future()
        self._transport.send(CallMethod(call_id, method, args))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    def has_engine_method(self, method: str) -> bool:
        """Whether ``call_engine(method)`` is available."""
        return method in CALLABLE_METHODS

    def inject_fault(self, exc: Optional[BaseException] = None, num_steps: int = 0) -> None:
        """Test hook: make the engine loop raise ``exc`` before its next step (it dies), or with
        ``num_steps > 0`` make each of the next ``num_steps`` steps raise it (``InjectFault``)."""
        self._transport.send(InjectFault(exc or RuntimeError("injected engine fault"), num_steps))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine loop; in-flight streams end with ``EngineDeadError``."""
        self._transport.shutdown(timeout_s)
        self._mark_dead(EngineDeadError("The engine was shut down."))
        if self._media_pool is not None:   # queued media jobs are dropped; running ones end on their own
            self._media_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------
    # Messages from the core (transport thread -> event loop)
    # ------------------------------------------------------------------------------------
    def _on_message(self, message: CoreMessage) -> None:
        """Runs on the transport's thread: one hand-off to the event loop per message."""
        if isinstance(message, EngineCoreOutputs):
            if message.stats is not None:
                self._stats = message.stats
            if message.outputs or message.rejected or message.failed:
                self._post(self._on_step, message)
        elif isinstance(message, CallResult):
            self._post(self._on_call_result, message)
        elif isinstance(message, EngineDead):
            self._mark_dead(EngineDeadError(message.message))

    def _on_step(self, message: EngineCoreOutputs) -> None:
        """Event loop: detokenize one step's outputs and hand each to its request's stream."""
        outputs, stopped = self.output_processor.process(message.outputs)
        if stopped and self._dead_error is None:
            self._transport.send(AbortRequests(stopped))
        now_s = time.monotonic()
        num_prompt = num_generated = 0
        ttfts: list[float] = []
        itls: list[float] = []
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:
                continue  # consumer already gone (aborted)
            num_new = self._count_new_tokens(state, out)
            if num_new:
                num_generated += num_new
                if state.first_token_s is None:
                    state.first_token_s = now_s
                    num_prompt += state.num_prompt_tokens
                    ttfts.append(now_s - state.arrival_s)
                else:
                    itls.append(now_s - state.last_token_s)
                state.last_token_s = now_s
            if out.finished:
                self._record_finished(state, out, now_s)
            state.collector.put(out)
        for request_id, error in message.rejected.items():
            state = self._states.get(request_id)
            self.output_processor.abort_requests([request_id])
            if state is not None:
                state.collector.put_error(error)
        if message.failed:
            self._fail_sequences(message.failed)
        if self.stat_loggers and (num_generated or num_prompt):
            for sl in self.stat_loggers:
                sl.on_step(num_prompt, num_generated, ttfts, itls)

    def _fail_sequences(self, failed: dict[str, BaseException]) -> None:
        """The core ended these sequences with an error: their requests end with it (the other
        sequences of an ``n > 1`` request are aborted in the core)."""
        for child_id, error in failed.items():
            child = self.output_processor.children.get(child_id)
            if child is None:
                continue   # its request already ended (a sibling failed, or the client left)
            request_id = child.parent.request_id
            _, siblings = self.output_processor.abort_requests([request_id])
            siblings = [cid for cid in siblings if cid not in failed]
            if siblings and self._dead_error is None:
                self._transport.send(AbortRequests(siblings))
            state = self._states.get(request_id)
            if state is not None:
                state.collector.put_error(error)

    @staticmethod
    def _count_new_tokens(state: _RequestState, out: RequestOutput) -> int:
        seen_by_index = state.num_tokens_by_index
        if state.params.output_kind == RequestOutputKind.DELTA:
            num_new = 0
            for c in out.outputs:
                n = len(c.token_ids)
                seen_by_index[c.index] = seen_by_index.get(c.index, 0) + n
                num_new += n
            return num_new
        num_new = 0
        for c in out.outputs:
            seen = seen_by_index.get(c.index, 0)
            num_new += max(0, len(c.token_ids) - seen)
            seen_by_index[c.index] = max(seen, len(c.token_ids))
        return num_new

    def _record_finished(self, state: _RequestState, out: RequestOutput, now_s: float) -> None:
        reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None)
        ttft = None if state.first_token_s is None else state.first_token_s - state.arrival_s
        for sl in self.stat_loggers:
            sl.on_finished(reason, state.num_prompt_tokens, state.num_generation_tokens,
                           now_s - state.arrival_s, ttft, state.params)

    def _on_call_result(self, result: CallResult) -> None:
        future = self._calls.pop(result.call_id, None)
        if future is None or future.done():
            return
        if result.error is not None:
            future.set_exception(result.error)
        else:
            future.set_result(result.value)

    # ------------------------------------------------------------------------------------
    # Plumbing
    # ------------------------------------------------------------------------------------
    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("AsyncLLM is bound to another event loop.")
        return loop

    def _release(self, state: _RequestState, send_abort: bool) -> None:
        """Forget a request on the event-loop side; abort it in the engine when asked."""
        if self._states.get(state.request_id) is state:
            del self._states[state.request_id]
        if state.timeout_handle is not None:
            state.timeout_handle.cancel()
        if send_abort:
            _, child_ids = self.output_processor.abort_requests([state.request_id])
            if child_ids and self._dead_error is None:
                if self.log_requests:
                    logger.info("Aborted request %s.", state.request_id)
                self._transport.send(AbortRequests(child_ids))

    def _on_request_timeout(self, state: _RequestState, timeout_s: float) -> None:
        """Event loop, ``timeout_s`` after the request arrived: abort it in the engine (its blocks are freed)
        and end its stream with ``RequestTimeoutError`` (outputs already made are delivered first)."""
        if self._states.get(state.request_id) is not state:
            return   # released meanwhile
        logger.info("Request %s timed out after %.1f s; aborting it.", state.request_id, timeout_s)
        self._release(state, send_abort=True)
        state.collector.put_error(RequestTimeoutError(
            f"The request did not finish within {timeout_s:g} s (--request-timeout) and was aborted; "
            "ask for fewer tokens (max_tokens), or raise --request-timeout."))

    def _mark_dead(self, error: EngineDeadError) -> None:
        """Any thread: refuse new work, then end every stream and call on the event loop."""
        with self._dead_lock:
            if self._dead_error is not None:
                return
            self._dead_error = error
        self._post(self._fail_all, error)

    def _fail_all(self, error: BaseException) -> None:
        for state in list(self._states.values()):
            state.collector.put_error(error)
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(error)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the event loop (from any thread); dropped if there is none."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop closed in between: nobody is listening


class RequestStream:
    """Async iterator over one request's ``RequestOutput``s; ends after the finished one.

    ``abort()`` (idempotent, synchronous) stops it and aborts the request in the engine unless it
    already finished. Cancelling a task blocked in ``__anext__`` aborts the request too.
    """

    def __init__(self, owner: AsyncLLM, state: _RequestState) -> None:
        self._owner = owner
        self._state = state
        self._closed = False

    @property
    def request_id(self) -> str:
        return self._state.request_id

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        try:
            item = await self._state.collector.get()
        except asyncio.CancelledError:  # the consumer went away
            self.abort()
            raise
        except BaseException:           # the engine died, or refused the request
            self._close(send_abort=False)
            raise
        if item.finished:
            self._state.finished = True
            self._close(send_abort=False)
        return item

    def abort(self) -> None:
        self._close(send_abort=not self._state.finished)

    def _close(self, send_abort: bool) -> None:
        if not self._closed:
            self._closed = True
            self._owner._release(self._state, send_abort)


def _short(prompt: Any, limit: int = 80) -> str:
    if isinstance(prompt, dict) and isinstance(prompt.get("multi_modal_data"), dict):
        # Not repr'd: a data URL can be megabytes. The prompt's head and the image count.
        images = prompt["multi_modal_data"].get("image")
        num_images = len(images) if isinstance(images, (list, tuple)) else int(images is not None)
        head = prompt.get("prompt", prompt.get("prompt_token_ids"))
        return f"{_short(head, limit)} + {num_images} image(s)"
    text = repr(prompt)
    return text if len(text) <= limit else text[:limit] + "...'"
