"""``AsyncLLM``: the asyncio client of an ``EngineCore``; ``generate()`` streams ``RequestOutput``s.

The core runs its loop in a thread of this process or in a process of its own; which one is the
transport's business (``engine/core_transport.py``) and nothing below depends on it:

    event loop (this object)                                  engine core (its loop)
    ------------------------                                  ----------------------
    add_request: admit (ids, prompts x n sequences)
        processor in the worker pool (validate,
        tokenize, fetch and decode media, n)        -- AddRequest ------------->  scheduler
        ValueError -> the caller (400), nothing sent
    stream.abort() / disconnect                     -- AbortRequests ---------->  frees blocks
    _on_step (one call_soon_threadsafe per step)   <-- EngineCoreOutputs (ids) --  step()
        output processor: detokenize, stop strings  -- AbortRequests (stopped) ->
        RequestOutput -> that request's collector (DELTA outputs merge while its consumer lags)
    call_engine("add_lora", ...)                    -- CallMethod / CallResult -

Every prompt is processed (tokenizing; for media: downloads, decoding, resizing, hashing) by a thread pool
of ``MultiModalConfig.mm_processor_workers`` threads, so neither a burst of images nor a huge prompt
stalls the event loop (streams, other requests, /health).

A request is admitted before anything of it is processed: its id is checked against every request and
sequence in flight (an ``n > 1`` request's sequences have ids ``{request_id}#{i}``, which no client id
can equal), and its sequences are counted against ``RequestLimits`` (the server's ``--max-queued-requests``)
from then until its stream closes, preprocessing included: beyond the bound ``EngineOverloadedError``
(503 + Retry-After), a request that could never fit a ``ValueError`` (400). A request whose task is
cancelled while it is preprocessed (its client left) is never sent to the core; it stays counted until
its worker finishes. ``RequestLimits.request_timeout_s`` bounds how long a request may live (a timer per
request aborts it in the engine: ``RequestTimeoutError``).
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
from engine.processor import sequence_ids
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput, SchedulerStats
from engine.sampling_params import RequestOutputKind, SamplingParams
from multimodal.budget import MediaBusyError

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
    """Sequences in flight beyond the engine's ``max_num_seqs`` (those cannot all be running: they wait).
    A request counts ``n`` sequences (a completion with several prompts: prompts x n, reserved at once by
    ``reserve_sequences``) from its arrival, before it is tokenized or its media fetched, until its stream
    closes; one that does not fit now is refused with ``EngineOverloadedError``, one that could never fit
    (more than ``max_num_seqs + max_queued_requests``) with ``ValueError``. None: no limit."""
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
class _Admission:
    """A request counted against ``RequestLimits`` and holding its id, from its arrival (before it is
    processed) until its stream closes, or until its worker finishes after it was cancelled."""

    request_id: str
    """The request's id (no other request or sequence in flight may take it meanwhile)."""
    sequence_ids: list[str]
    """The engine ids its sequences will have (``processor.sequence_ids``)."""
    num_seqs: int
    """Sequences it counts against ``RequestLimits.max_queued_requests``."""
    released: bool = False
    """Its sequences and ids were given back."""


class SequenceReservation:
    """Sequences reserved at once for the requests of one HTTP exchange (``AsyncLLM.reserve_sequences``);
    each ``add_request`` given it takes its ``n`` from here. ``release()`` gives back what was not taken."""

    def __init__(self, owner: "AsyncLLM", num_seqs: int) -> None:
        self._owner = owner
        self.num_left = num_seqs
        """Sequences reserved and not yet taken by a request."""

    def take(self, num_seqs: int) -> None:
        """Move ``num_seqs`` of the reservation to one request (beyond what is left: admitted anew)."""
        from_here = min(num_seqs, self.num_left)
        if num_seqs > from_here:
            self._owner._admit_sequences(num_seqs - from_here, param="n")
        self.num_left -= from_here

    def release(self) -> None:
        """Give back what no request took (idempotent)."""
        self._owner._num_seqs_in_flight -= self.num_left
        self.num_left = 0


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
    admission: Optional[_Admission] = None
    """Its count against ``RequestLimits`` and its ids; given back on release."""

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
        self._admissions: dict[str, _Admission] = {}
        """Every request admitted and not yet released, by id: being processed, or with a state."""
        self._sequence_owners: dict[str, str] = {}
        """Engine sequence id -> the id of the admitted request it belongs to."""
        self._num_seqs_in_flight = 0
        """Sequences admitted (requests' and ``SequenceReservation``s') and not yet given back."""
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._request_counter = itertools.count()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._dead_error: Optional[EngineDeadError] = None
        self._dead_lock = threading.Lock()
        self._stats = SchedulerStats()
        self._worker_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        """Processes prompts (tokenizing, media) off the event loop; made on first use."""
        self.limits = RequestLimits()
        """Queue bound and request timeout; the server sets them from its flags."""
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
        """Requests this client still tracks (admitted: being processed, or added and their stream not yet
        closed): 0 when idle."""
        return len(self._admissions)

    @property
    def num_sequences_in_flight(self) -> int:
        """Sequences counted against ``RequestLimits`` now: 0 when idle."""
        return self._num_seqs_in_flight

    def next_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._request_counter)}"

    # ------------------------------------------------------------------------------------
    # Event-loop API
    # ------------------------------------------------------------------------------------
    async def add_request(self, prompt: Any, sampling_params: SamplingParams, request_id: str,
                          lora_request: Optional["LoRARequest"] = None, priority: int = 0,
                          reservation: Optional[SequenceReservation] = None) -> "RequestStream":
        """Admit, validate, tokenize and submit one request (processed in the worker pool).

        ``reservation``: take the request's ``n`` sequences from it (``reserve_sequences``) instead of
        admitting them here.

        Raises:
            ValueError: a bad prompt or bad params, an id in use, more sequences than could ever fit
                (nothing reaches the engine).
            EngineOverloadedError: its sequences, or its media (``MediaBusyError``), do not fit now.
            EngineDeadError: the engine loop is dead.

        The caller must iterate the returned stream to its end or call ``stream.abort()``. A
        request the engine core itself refuses ends its stream with that error.
        """
        loop = self._bind_loop()
        if self._dead_error is not None:
            raise self._dead_error
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError("sampling_params: expected a SamplingParams.")
        n = sampling_params.n
        self.processor.check_n(n)
        admission = self._admit(request_id, n, reservation)
        arrival_s, arrival_time = time.monotonic(), time.time()
        cancelled = threading.Event()
        try:
            job = self._worker_executor().submit(self.processor.process, request_id, prompt, sampling_params,
                                                 lora_request, priority, arrival_time, cancelled=cancelled)
        except BaseException:   # the pool was shut down with the engine
            self._release_admission(admission)
            raise
        try:
            text, children = await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            # The caller left (client disconnect): nothing is sent; the worker, if it already runs, skips
            # the media it has not read or decoded yet and only then gives the request's count and ids back.
            cancelled.set()
            job.add_done_callback(lambda _: self._post(self._release_admission, admission))
            raise
        except MediaBusyError as e:
            self._release_admission(admission)
            raise EngineOverloadedError(str(e)) from e
        except BaseException:
            self._release_admission(admission)
            raise
        if self._dead_error is not None:   # the engine died meanwhile
            self._release_admission(admission)
            raise self._dead_error
        params = children[0].sampling_params
        collector = _OutputCollector(delta=params.output_kind == RequestOutputKind.DELTA)
        state = _RequestState(request_id, params, collector, arrival_s=arrival_s,
                              num_prompt_tokens=len(children[0].prompt_token_ids), admission=admission)
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

    def reserve_sequences(self, num_seqs: int, param: str = "n") -> SequenceReservation:
        """Count ``num_seqs`` sequences against ``RequestLimits`` at once, for several ``add_request`` calls
        (one HTTP request's prompts x n) that then take their share (``reservation=``); the caller
        ``release()``-s the reservation when they are added.

        Raises:
            ValueError: ``num_seqs`` could never fit (400, naming ``param``).
            EngineOverloadedError: they do not fit now (503).
            EngineDeadError: the engine loop is dead.
        """
        if self._dead_error is not None:
            raise self._dead_error
        self._admit_sequences(num_seqs, param)
        return SequenceReservation(self, num_seqs)

    def _admit_sequences(self, num_seqs: int, param: str) -> None:
        max_queued = self.limits.max_queued_requests
        if max_queued is not None:
            max_running = self.engine_config.scheduler_config.max_num_seqs
            bound = max_running + max_queued
            if num_seqs > bound:
                what = "prompts x n" if param == "prompt" else "n"
                raise ValueError(
                    f"{param}: the request has {num_seqs} sequences ({what}), more than this server ever holds "
                    f"at once ({max_running} running, --max-num-seqs, + {max_queued} waiting, "
                    "--max-queued-requests); send fewer prompts or a smaller n.")
            if self._num_seqs_in_flight + num_seqs > bound:
                raise EngineOverloadedError(
                    f"The server is overloaded: {self._num_seqs_in_flight} sequences are in flight ({max_running} "
                    f"run at once, {max_queued} may wait: --max-queued-requests) and this request has "
                    f"{num_seqs}; retry later.")
        self._num_seqs_in_flight += num_seqs

    def _admit(self, request_id: str, n: int, reservation: Optional[SequenceReservation]) -> _Admission:
        """Check the request's id and its sequences' ids against every request in flight, count its ``n``
        sequences (taken from ``reservation`` when given), and record it; nothing is written on a refusal."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}.")
        seq_ids = sequence_ids(request_id, n)
        taken = [i for i in [request_id, *seq_ids] if i in self._admissions or i in self._sequence_owners
                 or i in self.output_processor.children]
        if taken:
            raise ValueError(f"request_id: {request_id!r} is already in use.")
        if reservation is not None:
            reservation.take(n)
        else:
            self._admit_sequences(n, param="n")
        admission = _Admission(request_id, seq_ids, n)
        self._admissions[request_id] = admission
        for seq_id in seq_ids:
            self._sequence_owners[seq_id] = request_id
        return admission

    def _release_admission(self, admission: _Admission) -> None:
        """Give a request's sequences and ids back (idempotent)."""
        if admission.released:
            return
        admission.released = True
        self._num_seqs_in_flight -= admission.num_seqs
        if self._admissions.get(admission.request_id) is admission:
            del self._admissions[admission.request_id]
        for seq_id in admission.sequence_ids:
            if self._sequence_owners.get(seq_id) == admission.request_id:
                del self._sequence_owners[seq_id]

    def _worker_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._worker_pool is None:
            workers = self.engine_config.mm_config.mm_processor_workers
            self._worker_pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                                      thread_name_prefix="chorus-processor")
        return self._worker_pool

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
        if self._worker_pool is not None:   # queued jobs are dropped; running ones end on their own
            self._worker_pool.shutdown(wait=False, cancel_futures=True)

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
        if state.admission is not None:
            self._release_admission(state.admission)

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
    if isinstance(prompt, (str, list, tuple)) and len(prompt) > limit:
        prompt = prompt[:limit + 1]   # never the repr of a whole huge prompt
    text = repr(prompt)
    return text if len(text) <= limit else text[:limit] + "...'"
