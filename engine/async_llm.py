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
    call_engine(AddLoRA(...))                       -- CallEngine / CallResult -

Every prompt is processed (tokenizing; for media: downloads, decoding, resizing, hashing) by a thread pool
of ``MultiModalConfig.mm_processor_workers`` threads, so neither a burst of images nor a huge prompt
stalls the event loop (streams, other requests, /health).

A request is admitted (``engine/admission.py``: its id and its sequences, counted against
``RequestLimits``) before anything of it is processed; a request whose task is cancelled while it is
preprocessed (its client left) is never sent to the core. ``RequestLimits.request_timeout_s`` bounds how
long a request may live (a timer per request aborts it in the engine: ``RequestTimeoutError``). Each
request's outputs reach its consumer through a ``RequestStream`` (``engine/request_stream.py``); token
counts and latencies go to the ``StatLogger``s (``engine/request_metrics.py``).

Commands are FIFO, so an abort always lands after its add. When the core dies (an exception
escaped a step, a fault injected by a test, a killed process) every in-flight stream and call
gets ``EngineDeadError`` and new requests are refused with it (503 and a failed ``/health``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional

from engine.admission import Admission, AdmissionControl, SequenceReservation
from engine.core_messages import (AbortRequests, AddRequest, CallEngine, CallResult, CoreMessage, EngineCall,
                                  EngineCoreOutputs, EngineDead, InjectFault, refuse_non_call)
from engine.core_transport import EngineTransport, ProcessTransport, ThreadTransport
from engine.engine_core import freeze_gc_heap
from engine.errors import EngineDeadError
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput, SchedulerStats
from engine.request_limits import EngineOverloadedError, RequestLimits, RequestTimeoutError
from engine.request_metrics import RequestTimings, StatLogger, StepMetrics, report_finished
from engine.request_stream import OutputCollector, RequestStream, hand_to_owner
from engine.sampling_params import RequestOutputKind, SamplingParams
from multimodal.budget import MediaBusyError

if TYPE_CHECKING:
    from lora.request import LoRARequest

logger = logging.getLogger("chorus.async_llm")


@dataclass
class _RequestState:
    """Event-loop side bookkeeping of one in-flight request."""

    request_id: str
    """The user's request id (the parent of its ``n`` sequences)."""
    collector: OutputCollector
    """Outputs not yet taken by the stream's consumer."""
    timings: RequestTimings
    """Its resolved params, token counts and timestamps (``StatLogger``s)."""
    admission: Admission
    """Its count against ``RequestLimits`` and its ids; given back on release."""
    timeout_handle: Optional[asyncio.TimerHandle] = None
    """Fires ``RequestLimits.request_timeout_s`` after arrival (None: no timeout); cancelled on release."""


class AsyncLLM:
    """Async client of an engine core: ``generate()`` streams ``RequestOutput``s per request.

    Args:
        transport: a started-or-not ``EngineTransport`` (``ThreadTransport`` or
            ``ProcessTransport``); owned by this object from now on.
        log_requests: log each request's id, prompt head and params at INFO.
        stat_loggers: receivers of per-step token counts and timings (see ``StatLogger``).
        limits: the queue bound and request timeout (the server's flags; default: no bound).
    """

    def __init__(self, transport: EngineTransport, log_requests: bool = True,
                 stat_loggers: Optional[list[StatLogger]] = None, limits: Optional[RequestLimits] = None) -> None:
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
        self._admission = AdmissionControl(self.engine_config.scheduler_config.max_num_seqs, limits)
        """The ids and sequence counts of the requests admitted and not yet released."""
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._dead_error: Optional[EngineDeadError] = None
        self._dead_lock = threading.Lock()
        self._stats = SchedulerStats()
        self._worker_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        """Processes prompts (tokenizing, media) off the event loop; made on first use."""
        freeze_gc_heap()   # the tokenizer, processor and imports stay out of GC passes
        transport.start(self._on_message)

    @classmethod
    def from_engine_args(cls, log_requests: bool = True, engine_process: bool = False,
                         limits: Optional[RequestLimits] = None, **engine_kwargs: Any) -> "AsyncLLM":
        """Build the engine core: in a process of its own with ``engine_process``, else in the thread of
        this process that then runs its loop (``ThreadTransport``)."""
        if engine_process:
            return cls(ProcessTransport(engine_kwargs), log_requests=log_requests, limits=limits)
        from engine.arg_utils import EngineArgs
        from engine.engine_core import EngineCore
        args = EngineArgs.from_kwargs(**engine_kwargs)         # bad arguments fail here, in the caller
        return cls(ThreadTransport(lambda: EngineCore.from_engine_args(args)), log_requests=log_requests,
                   limits=limits)

    # ------------------------------------------------------------------------------------
    # Engine facts and health (safe from any thread)
    # ------------------------------------------------------------------------------------
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
        return self._admission.num_requests

    @property
    def num_sequences_in_flight(self) -> int:
        """Sequences counted against ``RequestLimits`` now: 0 when idle."""
        return self._admission.num_seqs_in_flight

    @property
    def limits(self) -> RequestLimits:
        """Queue bound and request timeout (the server's from its flags)."""
        return self._admission.limits

    # ------------------------------------------------------------------------------------
    # Event-loop API
    # ------------------------------------------------------------------------------------
    async def add_request(self, prompt: Any, sampling_params: SamplingParams, request_id: str,
                          lora_request: Optional["LoRARequest"] = None, priority: int = 0,
                          reservation: Optional[SequenceReservation] = None) -> RequestStream:
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
        admission = self._admission.admit(request_id, n, reservation, self.output_processor.children)
        arrival_s, arrival_time = time.monotonic(), time.time()
        cancelled = threading.Event()
        try:
            job = self._worker_executor().submit(self.processor.process, request_id, prompt, sampling_params,
                                                 lora_request, priority, arrival_time, cancelled=cancelled)
        except BaseException:   # the pool was shut down with the engine
            self._admission.release(admission)
            raise
        try:
            text, children = await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            # The caller left (client disconnect): nothing is sent; the worker, if it already runs, skips
            # the media it has not read or decoded yet and only then gives the request's count and ids back.
            cancelled.set()
            job.add_done_callback(lambda _: self._post(self._admission.release, admission))
            raise
        except MediaBusyError as e:
            self._admission.release(admission)
            raise EngineOverloadedError(str(e)) from e
        except BaseException:
            self._admission.release(admission)
            raise
        if self._dead_error is not None:   # the engine died meanwhile
            self._admission.release(admission)
            raise self._dead_error
        params = children[0].sampling_params
        collector = OutputCollector(delta=params.output_kind == RequestOutputKind.DELTA)
        timings = RequestTimings(params, arrival_s, num_prompt_tokens=len(children[0].prompt_token_ids))
        state = _RequestState(request_id, collector, timings, admission)
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
        stream = RequestStream(request_id, collector, lambda send_abort: self._release(state, send_abort))
        hand_to_owner(stream)
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
        return self._admission.reserve(num_seqs, param)

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

    async def call_engine(self, call: EngineCall) -> Any:
        """Run ``call`` in the core between steps (``AddLoRA``, ``RemoveLoRA``, ``ListLoRAs``,
        ``ResetPrefixCache``, ``GetStats``: ``EngineCall``) and return its answer. Raises TypeError,
        sending nothing, for anything else."""
        refuse_non_call(call)
        loop = self._bind_loop()
        if self._dead_error is not None:
            raise self._dead_error
        call_id = next(self._call_ids)
        future = self._calls[call_id] = loop.create_future()
        self._transport.send(CallEngine(call_id, call))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

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
        step_metrics = StepMetrics()
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:
                continue  # consumer already gone (aborted)
            step_metrics.observe(state.timings, out, now_s)
            if out.finished:
                report_finished(self.stat_loggers, state.timings, out, now_s)
            state.collector.put(out)
        for request_id, error in message.rejected.items():
            state = self._states.get(request_id)
            self.output_processor.abort_requests([request_id])
            if state is not None:
                state.collector.put_error(error)
        if message.failed:
            self._fail_sequences(message.failed)
        step_metrics.report(self.stat_loggers)

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
        self._admission.release(state.admission)

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
