"""``AsyncLLM``: the engine loop in a background thread, one asyncio stream per request.

Threads and ownership (the ``LLMEngine`` is not thread-safe, so exactly one thread touches it):

    event loop (HTTP)                                 engine thread
    -----------------                                 -------------
    generate(): register a _RequestState      ->      _commands (queue.Queue, FIFO)
        put ("add", ..., future) ------------>        drain all commands, then engine.step()
        await the future (ValueError -> 400)  <-      future.set_result / set_exception
        await state.queue.get()              <-      loop.call_soon_threadsafe(_dispatch, outputs)
    disconnect / cancel -> put ("abort", id) ->      engine.abort_request([id])

Commands are FIFO, so an abort always lands after its add. The engine thread blocks on the command
queue while the engine has nothing to do, and polls it (non-blocking) between steps otherwise.

An exception escaping ``step()`` (or a fault injected by a test) kills the loop: every in-flight
stream gets ``EngineDeadError``, pending commands fail with it, and new requests are refused with
it (the server turns it into 503 and a failed ``/health``).

With ``engine_process=True`` (``chorus serve --engine-process``) the loop runs in a child process
instead (``engine.engine_core``): the same commands travel through a pipe, the outputs come back
through a receiver thread, and nothing of the engine's host work competes with HTTP for the GIL.
Everything above holds in both modes; only ``run_in_engine`` (arbitrary callables) is thread-only,
``call_engine`` (named methods) works in both.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional, Protocol

from engine.outputs import RequestOutput, SchedulerStats
from engine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from lora.request import LoRARequest

logger = logging.getLogger("chorus.async_llm")

_STOP = object()
"""Sentinel command: leave the engine loop."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (crashed or shut down); no request can be served."""


class StatLogger(Protocol):
    """What the async layer reports per request; ``server/metrics.py`` implements it."""

    def on_output(self, num_new_tokens: int, ttft_s: Optional[float], itl_s: Optional[float]) -> None:
        ...

    def on_first_output(self, num_prompt_tokens: int) -> None:
        ...

    def on_finished(self, finish_reason: Optional[str], num_prompt_tokens: int, num_generation_tokens: int,
                    e2e_s: float, ttft_s: Optional[float], params: SamplingParams) -> None:
        ...


@dataclass
class _RequestState:
    """Event-loop side bookkeeping of one in-flight request."""

    request_id: str
    params: SamplingParams
    queue: asyncio.Queue
    """RequestOutput items, or an exception that ends the stream."""
    arrival_s: float
    """time.monotonic() when generate() was called."""
    first_token_s: Optional[float] = None
    last_token_s: Optional[float] = None
    num_prompt_tokens: int = 0
    num_tokens_by_index: dict[int, int] = field(default_factory=dict)
    """Sample index -> generated tokens seen so far (for counters; works for every output kind)."""
    seen_first_output: bool = False
    finished: bool = False

    @property
    def num_generation_tokens(self) -> int:
        return sum(self.num_tokens_by_index.values())


@dataclass
class _AddCommand:
    request_id: str
    prompt: Any
    params: SamplingParams
    lora_request: Optional["LoRARequest"]
    priority: int
    arrival_time: float
    future: concurrent.futures.Future
    processed: Optional[tuple[Any, Any]] = None
    """(prompt text, engine requests) from ``engine.processor.process``, done on the event loop."""


class AsyncLLM:
    """Async front of an ``LLMEngine``: ``generate()`` streams ``RequestOutput``s per request.

    Args:
        engine: a constructed ``LLMEngine`` (owned by this object from now on); with ``core``, the
            ``EngineFacade`` of the engine process.
        log_requests: log each request's id, prompt head and params at INFO.
        stat_loggers: receivers of per-request timing and token counts (see ``StatLogger``).
        core: an ``engine.engine_core.EngineCoreClient``: the engine runs in that process (then no
            engine thread is started here).
    """

    def __init__(self, engine: Any, log_requests: bool = True,
                 stat_loggers: Optional[list[StatLogger]] = None, core: Any = None) -> None:
        self.engine = engine
        self._core = core
        """``EngineCoreClient`` when the engine runs in its own process, else None."""
        self.log_requests = log_requests
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self._commands: queue.Queue = queue.Queue()
        self._states: dict[str, _RequestState] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._dead_error: Optional[EngineDeadError] = None
        self._dead_lock = threading.Lock()
        """Held while checking-and-enqueuing, and while marking dead + failing pending commands."""
        self._stats: SchedulerStats = self._safe_stats() if core is None else SchedulerStats()
        self._can_preprocess = core is not None or (hasattr(engine, "processor") and hasattr(engine, "add_processed"))
        """The engine's processor is stateless, so requests are validated on the event loop."""
        self._request_counter = itertools.count()
        self._thread = threading.Thread(target=self._run_engine_loop, name="chorus-engine", daemon=True)
        if core is None:
            self._thread.start()
        else:
            core.start(on_outputs=lambda outputs, now_s: self._post(self._dispatch, outputs, now_s),
                       on_stats=self._set_stats,
                       on_dead=lambda message: self._mark_dead(EngineDeadError(message)))

    @classmethod
    def from_engine_args(cls, log_requests: bool = True, engine_process: bool = False,
                         **engine_kwargs: Any) -> "AsyncLLM":
        """Build the engine: in this process (a thread runs its loop) or, with ``engine_process``,
        in a child process of its own."""
        if engine_process:
            from engine.engine_core import EngineCoreClient, EngineFacade
            core = EngineCoreClient(engine_kwargs)
            return cls(EngineFacade(core.facts), log_requests=log_requests, core=core)
        from engine.llm_engine import LLMEngine
        return cls(LLMEngine.from_engine_args(**engine_kwargs), log_requests=log_requests)

    def _set_stats(self, stats: SchedulerStats) -> None:
        self._stats = stats

    # ------------------------------------------------------------------------------------
    # Engine facts (read-only after construction, safe from any thread)
    # ------------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def engine_config(self) -> Any:
        return self.engine.engine_config

    @property
    def is_running(self) -> bool:
        return self._dead_error is None and self._loop_alive()

    def _loop_alive(self) -> bool:
        return self._core.is_alive() if self._core is not None else self._thread.is_alive()

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
        if not self._loop_alive():
            raise EngineDeadError("The engine loop is not running.")

    def get_stats(self) -> SchedulerStats:
        """The scheduler snapshot taken after the engine's latest step (or idle drain)."""
        return self._stats

    def next_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._request_counter)}"

    # ------------------------------------------------------------------------------------
    # Event-loop API
    # ------------------------------------------------------------------------------------
    async def add_request(self, prompt: Any, sampling_params: SamplingParams, request_id: str,
                          lora_request: Optional["LoRARequest"] = None,
                          priority: int = 0) -> "RequestStream":
        """Submit one request; return once the engine accepted it.

        Raises:
            ValueError: the engine rejected the request (bad prompt or params); nothing runs.
            EngineDeadError: the engine loop is dead.

        The caller must iterate the returned stream to its end or call ``stream.abort()``.
        """
        self._bind_loop()
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        state = _RequestState(request_id=request_id, params=sampling_params, queue=asyncio.Queue(),
                              arrival_s=time.monotonic())
        arrival_time = time.time()
        processed = None
        if self._can_preprocess:
            # Validate and tokenize here, off the engine thread (as vLLM's frontend processor):
            # a bad request fails at once with ValueError and nothing reaches the engine.
            processed = self.engine.processor.process(request_id, prompt, sampling_params, lora_request,
                                                      priority, arrival_time)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_AddCommand(request_id, prompt, sampling_params, lora_request, priority, arrival_time,
                                 future, processed))
        self._states[request_id] = state
        stream = RequestStream(self, state)
        try:
            await asyncio.wrap_future(future)
        except BaseException:
            # Rejected: nothing to abort. Cancelled: the add may still happen, so abort it.
            rejected = future.done() and not future.cancelled() and future.exception() is not None
            stream._close(send_abort=not rejected)
            raise
        if self.log_requests:
            logger.info("Added request %s: prompt=%s, params=%s, lora=%s", request_id, _short(prompt),
                        sampling_params, getattr(lora_request, "lora_name", None))
        return stream

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
        """Abort requests by id (their streams end when the generator is closed by its owner)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._put_nowait(("abort", ids))

    async def run_in_engine(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result (thread
        mode only: a callable cannot travel to the engine process; use ``call_engine`` there)."""
        if self._core is not None:
            raise RuntimeError("run_in_engine needs the in-process engine; use call_engine(method, ...).")
        self._bind_loop()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", fn, future))
        return await asyncio.wrap_future(future)

    async def call_engine(self, method: str, *args: Any) -> Any:
        """``engine.<method>(*args)`` between steps, in either mode (``add_lora``, ``remove_lora``,
        ``list_loras``, ``reset_prefix_cache``; see ``engine.engine_core.CALLABLE_METHODS``)."""
        if self._core is None:
            return await self.run_in_engine(lambda engine: getattr(engine, method)(*args))
        self._bind_loop()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._dead_lock:
            if self._dead_error is not None:
                raise self._dead_error
        inner = self._core.call(method, *args)
        inner.add_done_callback(lambda f: _transfer(f, future))
        return await asyncio.wrap_future(future)

    def has_engine_method(self, method: str) -> bool:
        """Whether ``call_engine(method)`` is available (fake engines in tests may lack some)."""
        if self._core is not None:
            from engine.engine_core import CALLABLE_METHODS
            return method in CALLABLE_METHODS
        return hasattr(self.engine, method)

    def inject_fault(self, exc: Optional[BaseException] = None) -> None:
        """Test hook: make the engine loop raise ``exc`` before its next step (it dies)."""
        if self._core is not None:
            self._core.fault(exc or RuntimeError("injected engine fault"))
            return
        self._put_nowait(("fault", exc or RuntimeError("injected engine fault")))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine loop; in-flight streams end with ``EngineDeadError``."""
        if self._core is not None:
            self._core.shutdown(timeout_s)
        elif self._thread.is_alive():
            self._put_nowait(_STOP)
            self._thread.join(timeout_s)
        self._mark_dead(EngineDeadError("The engine was shut down."))

    # ------------------------------------------------------------------------------------
    # Plumbing, event-loop side
    # ------------------------------------------------------------------------------------
    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("AsyncLLM is bound to another event loop.")

    def _submit(self, command: Any) -> None:
        """Enqueue a command with a future; raise EngineDeadError if the loop is dead."""
        with self._dead_lock:
            if self._dead_error is not None:
                raise self._dead_error
            if self._core is not None:   # only adds carry a future here (calls use call_engine)
                self._core.add(command.request_id, *command.processed, command.future)
                return
            self._commands.put(command)

    def _put_nowait(self, command: Any) -> None:
        with self._dead_lock:
            if self._dead_error is None:
                if self._core is not None:   # ("abort", ids): the only command without a future
                    self._core.abort(command[1])
                    return
                self._commands.put(command)

    def _dispatch(self, outputs: list[RequestOutput], now_s: float) -> None:
        """Runs on the event loop: route each output to its request's queue, record stats."""
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:
                continue  # consumer already gone (aborted)
            self._record(state, out, now_s)
            state.queue.put_nowait(out)

    def _record(self, state: _RequestState, out: RequestOutput, now_s: float) -> None:
        if not state.seen_first_output:
            state.seen_first_output = True
            state.num_prompt_tokens = len(out.prompt_token_ids or [])
            for sl in self.stat_loggers:
                sl.on_first_output(state.num_prompt_tokens)
        delta = state.params.output_kind == RequestOutputKind.DELTA
        num_new = 0
        for c in out.outputs:
            seen = state.num_tokens_by_index.get(c.index, 0)
            total = seen + len(c.token_ids) if delta else len(c.token_ids)
            num_new += max(0, total - seen)
            state.num_tokens_by_index[c.index] = total
        ttft = itl = None
        if num_new:
            if state.first_token_s is None:
                state.first_token_s = now_s
                ttft = now_s - state.arrival_s
            else:
                itl = now_s - (state.last_token_s or now_s)
            state.last_token_s = now_s
        for sl in self.stat_loggers:
            sl.on_output(num_new, ttft, itl)
        if out.finished:
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None)
            ttft_total = None if state.first_token_s is None else state.first_token_s - state.arrival_s
            for sl in self.stat_loggers:
                sl.on_finished(reason, state.num_prompt_tokens, state.num_generation_tokens,
                               now_s - state.arrival_s, ttft_total, state.params)

    def _release(self, state: _RequestState, send_abort: bool) -> None:
        """Forget a request on the event-loop side; abort it in the engine when asked."""
        if self._states.get(state.request_id) is state:
            del self._states[state.request_id]
        if send_abort and self._dead_error is None:
            if self.log_requests:
                logger.info("Aborted request %s.", state.request_id)
            self._put_nowait(("abort", [state.request_id]))

    def _fail_all(self, error: BaseException) -> None:
        """Runs on the event loop: end every in-flight stream with ``error``."""
        for state in list(self._states.values()):
            state.queue.put_nowait(error)

    # ------------------------------------------------------------------------------------
    # Engine thread
    # ------------------------------------------------------------------------------------
    def _run_engine_loop(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if not self._drain_commands(block=not busy):
                    return
                if not self.engine.has_unfinished_requests():
                    self._stats = self._safe_stats()  # e.g. blocks freed by an abort
                    continue
                outputs = self.engine.step()
                now_s = time.monotonic()
                self._stats = self.engine.get_stats()
                if outputs:
                    self._post(self._dispatch, outputs, now_s)
        except BaseException as e:  # noqa: BLE001 - any escape kills the engine, by design
            logger.exception("Engine loop died.")
            self._mark_dead(EngineDeadError(f"Engine loop died: {e!r}"))

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; block for the first one when idle. False: stop the loop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is _STOP:
                return False
            self._apply(command)

    def _apply(self, command: Any) -> None:
        if isinstance(command, _AddCommand):
            if not command.future.set_running_or_notify_cancel():
                return  # the caller went away before the request was added
            try:
                if command.processed is not None:
                    self.engine.add_processed(command.request_id, *command.processed)
                else:
                    self.engine.add_request(command.request_id, command.prompt, command.params,
                                            lora_request=command.lora_request, priority=command.priority,
                                            arrival_time=command.arrival_time)
            except Exception as e:  # noqa: BLE001 - the caller decides (ValueError -> 400)
                command.future.set_exception(e)
            else:
                command.future.set_result(None)
            return
        kind = command[0]
        if kind == "abort":
            try:
                outputs = self.engine.abort_request(command[1])
            except Exception:  # noqa: BLE001 - e.g. an id that already finished
                logger.exception("abort_request(%s) failed.", command[1])
                return
            if outputs:  # reaches only streams still listening
                self._post(self._dispatch, list(outputs), time.monotonic())
        elif kind == "call":
            _, fn, future = command
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001
                future.set_exception(e)
        elif kind == "fault":
            raise command[1]
        else:
            raise AssertionError(f"unknown engine command {kind!r}")

    def _mark_dead(self, error: EngineDeadError) -> None:
        with self._dead_lock:
            if self._dead_error is not None:
                return
            self._dead_error = error
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        for command in pending:
            future = command.future if isinstance(command, _AddCommand) else (
                command[2] if isinstance(command, tuple) and command[0] == "call" else None)
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(error)
        self._post(self._fail_all, error)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the event loop (from the engine thread); dropped if there is none."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop closed in between: nobody is listening

    def _safe_stats(self) -> SchedulerStats:
        try:
            return self.engine.get_stats()
        except Exception:  # noqa: BLE001 - stats must never take the loop down
            return SchedulerStats()


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
            item = await self._state.queue.get()
        except BaseException:  # CancelledError: the consumer went away
            self.abort()
            raise
        if isinstance(item, BaseException):
            self._close(send_abort=False)
            raise item
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


def _transfer(src: concurrent.futures.Future, dst: concurrent.futures.Future) -> None:
    """Copy a finished future's outcome into another (if that one was not cancelled)."""
    if not dst.set_running_or_notify_cancel():
        return
    if src.cancelled():
        dst.set_exception(EngineDeadError("The engine call was cancelled."))
    elif src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())


def _short(prompt: Any, limit: int = 80) -> str:
    text = repr(prompt)
    return text if len(text) <= limit else text[:limit] + "...'"
