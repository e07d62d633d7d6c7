"""The engine loop in a process of its own (``chorus serve --engine-process``), and its client.

Why: in one process the HTTP server, SSE framing, tokenization and the engine loop share one GIL,
so a busy server slows the engine's host work (scheduling, input preparation, detokenization)
and the GPU waits. With the engine in a child process the two only exchange pickled messages.

    API process (AsyncLLM + EngineCoreClient)              engine process (run_engine_core)
    -----------------------------------------              --------------------------------
    validate + tokenize (a copy of the Processor)
    ("add", cmd_id, request_id, text, children) --> commands  -> engine.add_processed
    ("abort", ids) / ("call", cmd_id, method, args) -------->    engine.abort_request / engine.<method>
    receiver thread <-- results <-- ("done", cmd_id, value, error)
                                <-- ("outputs", [RequestOutput], time, SchedulerStats) after each step
                                <-- ("dead", message) when the loop dies

The child steps on its own whenever it has work (it never waits for the parent between steps);
the parent's receiver thread blocks on the result queue (the GIL is free meanwhile) and hands
each message to the event loop. Commands are FIFO, so an abort always lands after its add. The
child is started with ``spawn`` (CUDA cannot be forked) and ignores SIGINT: the API process owns
shutdown. If the child dies without a word (killed, segfault) the receiver notices its exit.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

from engine.outputs import RequestOutput, SchedulerStats

logger = logging.getLogger("chorus.engine_core")

_POLL_S = 0.5
"""How often the receiver checks that the child is alive while no message arrives."""


@dataclass
class EngineFacts:
    """What the API process needs from the engine, sent once by the child when it is ready."""

    model_name: str
    max_model_len: int
    engine_config: Any
    tokenizer: Any
    """The engine's tokenizer (pickled): /tokenize, chat templates, detokenizing token-id prompts."""
    processor: Any
    """A copy of the engine's stateless ``Processor``: requests are validated in the API process."""
    default_sampling_params: dict
    """The checkpoint's generation_config defaults."""
    lora_enabled: bool


class EngineFacade:
    """Stands in for ``LLMEngine`` in the API process: its facts (``model_name``, ``tokenizer``,
    ``processor``, ...; read through to ``EngineFacts``), nothing that runs the model."""

    def __init__(self, facts: EngineFacts) -> None:
        self.facts = facts

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["facts"], name)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None, continue_final_message: bool = False,
                            **kwargs) -> str:
        return self.processor.apply_chat_template(messages, add_generation_prompt, chat_template,
                                                  continue_final_message, **kwargs)


# ----------------------------------------------------------------------------------------
# Child process
# ----------------------------------------------------------------------------------------
CALLABLE_METHODS = ("add_lora", "remove_lora", "list_loras", "reset_prefix_cache", "get_stats")
"""Engine methods the API process may call by name (arguments and results are pickled)."""


def run_engine_core(engine_kwargs: dict, commands: "mp.Queue", results: "mp.Queue") -> None:
    """Entry point of the engine process: build the engine, report ready, loop until stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        from engine.llm_engine import LLMEngine
        engine = LLMEngine.from_engine_args(**engine_kwargs)
        results.put(("ready", EngineFacts(
            model_name=engine.model_name, max_model_len=engine.max_model_len,
            engine_config=engine.engine_config, tokenizer=engine.tokenizer, processor=engine.processor,
            default_sampling_params=engine.default_sampling_params,
            lora_enabled=engine.lora_manager is not None)))
    except BaseException as e:  # noqa: BLE001 - start-up errors go to the parent, which raises them
        results.put(("failed", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    try:
        _loop(engine, commands, results)
    except BaseException as e:  # noqa: BLE001 - any escape kills the engine, by design
        logger.exception("Engine loop died.")
        results.put(("dead", f"Engine loop died: {e!r}"))


class _PromptElision:
    """Sends each request's prompt (text, token ids, adapter) with its first output only; later
    outputs carry None there and the API process puts them back (a 512-token prompt would
    otherwise be pickled again on every step of every request)."""

    def __init__(self) -> None:
        self._sent: set[str] = set()
        """Child side: requests whose prompt already went out."""
        self._prompts: dict[str, tuple] = {}
        """Parent side: request id -> (prompt, prompt_token_ids, lora_request)."""

    def slim(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        out = []
        for o in outputs:
            if o.request_id in self._sent:
                o = dataclasses.replace(o, prompt=None, prompt_token_ids=None, lora_request=None)
            else:
                self._sent.add(o.request_id)
            if o.finished:
                self._sent.discard(o.request_id)
            out.append(o)
        return out

    def restore(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for o in outputs:
            if o.prompt_token_ids is None:
                o.prompt, o.prompt_token_ids, o.lora_request = self._prompts[o.request_id]
            else:
                self._prompts[o.request_id] = (o.prompt, o.prompt_token_ids, o.lora_request)
            if o.finished:
                self._prompts.pop(o.request_id, None)
        return outputs


def _loop(engine, commands: "mp.Queue", results: "mp.Queue") -> None:
    elision = _PromptElision()
    parent = os.getppid()
    while True:
        block = not engine.has_unfinished_requests()
        while True:
            try:
                command = commands.get(block=block, timeout=_POLL_S if block else None)
            except queue.Empty:
                if block and os.getppid() != parent:
                    return   # the API process died without a word (SIGKILL): do not linger
                if block:
                    continue
                break
            block = False
            if command[0] == "stop":
                return
            _apply(engine, command, results, elision)
        if not engine.has_unfinished_requests():
            results.put(("stats", engine.get_stats()))   # e.g. blocks freed by an abort
            continue
        outputs = engine.step()
        results.put(("outputs", elision.slim(outputs), time.monotonic(), engine.get_stats()))


def _apply(engine, command: tuple, results: "mp.Queue", elision: _PromptElision) -> None:
    kind = command[0]
    if kind == "add":
        _, cmd_id, request_id, text, children = command
        try:
            engine.add_processed(request_id, text, children)
        except Exception as e:  # noqa: BLE001 - the caller decides (ValueError -> 400)
            results.put(("done", cmd_id, None, _portable(e)))
        else:
            results.put(("done", cmd_id, None, None))
    elif kind == "abort":
        try:
            outputs = engine.abort_request(command[1])
        except Exception:  # noqa: BLE001 - e.g. an id that already finished
            logger.exception("abort_request(%s) failed.", command[1])
            return
        if outputs:
            results.put(("outputs", elision.slim(list(outputs)), time.monotonic(), engine.get_stats()))
    elif kind == "call":
        _, cmd_id, method, args = command
        try:
            if method not in CALLABLE_METHODS:
                raise AttributeError(f"engine method {method!r} cannot be called remotely.")
            value = getattr(engine, method)(*args)
        except Exception as e:  # noqa: BLE001
            results.put(("done", cmd_id, None, _portable(e)))
        else:
            results.put(("done", cmd_id, value, None))
    elif kind == "fault":
        raise command[1]
    else:
        raise AssertionError(f"unknown engine command {kind!r}")


def _portable(error: Exception) -> Exception:
    """The error itself if it survives pickling (ours do: ValueError and the LoRA errors keep
    their 4xx mapping), else a RuntimeError carrying its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - e.g. an exception class with a custom __init__
        return RuntimeError(f"{type(error).__name__}: {error}")


# ----------------------------------------------------------------------------------------
# API process
# ----------------------------------------------------------------------------------------
class EngineCoreClient:
    """Starts the engine process and talks to it.

    Args:
        engine_kwargs: ``EngineArgs`` fields (pickled to the child).
        startup_timeout_s: how long to wait for the model to load.

    ``start(on_outputs, on_stats, on_dead)`` then starts the receiver thread: ``on_outputs(outputs,
    monotonic time of the step)`` and ``on_stats(SchedulerStats)`` run on it for each message,
    ``on_dead(message)`` once when the engine is gone.

    Raises:
        RuntimeError: the engine failed to start (its error message and traceback included).
    """

    def __init__(self, engine_kwargs: dict, startup_timeout_s: float = 1800.0) -> None:
        ctx = mp.get_context("spawn")
        self._commands = ctx.Queue()
        self._results = ctx.Queue()
        self._proc = ctx.Process(target=run_engine_core, args=(engine_kwargs, self._commands, self._results),
                                 name="chorus-engine-core", daemon=True)
        self._proc.start()
        self._on_outputs: Callable[[list[RequestOutput], float], None] = lambda outputs, now_s: None
        self._on_stats: Callable[[SchedulerStats], None] = lambda stats: None
        self._on_dead: Callable[[str], None] = lambda message: None
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._elision = _PromptElision()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._dead = False
        self.facts = self._wait_ready(startup_timeout_s)
        self._receiver = threading.Thread(target=self._receive, name="chorus-engine-client", daemon=True)

    def start(self, on_outputs: Callable[[list[RequestOutput], float], None],
              on_stats: Callable[[SchedulerStats], None], on_dead: Callable[[str], None]) -> None:
        """Bind the callbacks and start receiving (once)."""
        self._on_outputs, self._on_stats, self._on_dead = on_outputs, on_stats, on_dead
        self._receiver.start()

    def _wait_ready(self, timeout_s: float) -> EngineFacts:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self._results.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._proc.is_alive():
                    raise RuntimeError(f"The engine process exited during start-up "
                                       f"(exit code {self._proc.exitcode}).") from None
                if time.monotonic() > deadline:
                    self._proc.kill()
                    raise RuntimeError(f"The engine did not start within {timeout_s:.0f} s.") from None
        if msg[0] == "failed":
            self._proc.join(5)
            raise RuntimeError(f"The engine failed to start: {msg[1]}\n{msg[2]}")
        return msg[1]

    # ------------------------------------------------------------------ commands
    def add(self, request_id: str, text: Any, children: Any, future: concurrent.futures.Future) -> None:
        """Queue a processed request; ``future`` resolves once the engine accepted it (or raises)."""
        cmd_id = self._register(future)
        self._commands.put(("add", cmd_id, request_id, text, children))

    def call(self, method: str, *args: Any) -> concurrent.futures.Future:
        """Call ``engine.<method>(*args)`` in the engine process (one of ``CALLABLE_METHODS``)."""
        if method not in CALLABLE_METHODS:
            raise AttributeError(f"engine method {method!r} cannot be called remotely; "
                                 f"use one of {CALLABLE_METHODS}.")
        future: concurrent.futures.Future = concurrent.futures.Future()
        cmd_id = self._register(future)
        self._commands.put(("call", cmd_id, method, args))
        return future

    def abort(self, request_ids: list[str]) -> None:
        if not self._dead:
            self._commands.put(("abort", list(request_ids)))

    def fault(self, exc: BaseException) -> None:
        """Test hook: the engine loop raises ``exc`` (and dies)."""
        self._commands.put(("fault", exc))

    def is_alive(self) -> bool:
        return not self._dead and self._proc.is_alive()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process (asking first, then terminating it)."""
        if self._proc.is_alive():
            try:
                self._commands.put(("stop",))
            except (ValueError, OSError):
                pass
            self._proc.join(timeout_s)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
        self._set_dead("The engine was shut down.")

    # ------------------------------------------------------------------ receiver thread
    def _register(self, future: concurrent.futures.Future) -> int:
        from engine.async_llm import EngineDeadError
        with self._lock:
            if self._dead:
                raise EngineDeadError("The engine process is not running.")
            cmd_id = next(self._ids)
            self._futures[cmd_id] = future
            return cmd_id

    def _receive(self) -> None:
        while not self._dead:
            try:
                msg = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._proc.is_alive():
                    self._set_dead(f"The engine process exited (exit code {self._proc.exitcode}).")
                continue
            except (EOFError, OSError):
                self._set_dead("The engine process's result queue closed.")
                return
            except Exception as e:  # noqa: BLE001 - a message that cannot be read: the link is broken
                logger.exception("Unreadable message from the engine process.")
                self._set_dead(f"Unreadable message from the engine process: {e!r}")
                return
            kind = msg[0]
            if kind == "outputs":
                self._on_stats(msg[3])
                self._on_outputs(self._elision.restore(msg[1]), msg[2])
            elif kind == "stats":
                self._on_stats(msg[1])
            elif kind == "done":
                _, cmd_id, value, error = msg
                with self._lock:
                    future = self._futures.pop(cmd_id, None)
                if future is not None and future.set_running_or_notify_cancel():
                    if error is not None:
                        future.set_exception(error)
                    else:
                        future.set_result(value)
            elif kind == "dead":
                self._set_dead(msg[1])

    def _set_dead(self, message: str) -> None:
        with self._lock:
            if self._dead:
                return
            self._dead = True
            pending = list(self._futures.values())
            self._futures.clear()
        from engine.async_llm import EngineDeadError
        error = EngineDeadError(message)
        for future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        self._on_dead(message)
