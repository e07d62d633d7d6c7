"""How an engine client reaches its ``EngineCore``: a thread of this process, or a process of its own.

Both run the same ``EngineCore.run`` loop; they differ only in how commands and messages travel:

    ThreadTransport                                   ProcessTransport (spawn)
    ---------------                                   ------------------------
    the engine thread builds the core                 the engine process builds the core
    send(cmd) -> queue.SimpleQueue -> engine thread   send(cmd) -> mp.Queue (pickled) -> engine process
    engine thread: on_message(msg) directly           engine process -> mp.Queue -> receiver thread:
                                                          on_message(msg)

``on_message`` runs on a thread of the transport's own (never the client's event loop): the client
hands each message to its loop with one ``call_soon_threadsafe``. An engine process builds its
engine, sends ``EngineReady`` (or ``EngineStartupFailed``), ignores SIGINT (the API process owns
shutdown) and exits when the API process is gone. A child that dies without a word (killed,
segfault) is noticed by the receiver thread, which reports ``EngineDead``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import traceback
from typing import Callable, Optional, Protocol

from engine.core_messages import (CallResult, CoreMessage, EngineCommand, EngineCoreOutputs, EngineDead,
                                  EngineFacts, EngineReady, EngineStartupFailed, Shutdown)
from engine.engine_core import EngineCore
from engine.errors import EngineStartupError

logger = logging.getLogger("chorus.core_transport")

_POLL_S = 0.5
"""How often a blocked reader checks that the other side is still alive."""

OnMessage = Callable[[CoreMessage], None]


class EngineTransport(Protocol):
    """The client's end: ``facts`` once the engine is built, then commands in and messages out."""

    facts: EngineFacts

    def start(self, on_message: OnMessage) -> None:
        """Start the loop (once); ``on_message`` receives every ``CoreMessage``, in order."""

    def send(self, command: EngineCommand) -> None:
        """Queue one command (FIFO: an abort always lands after its add)."""

    def is_alive(self) -> bool:
        """Whether the loop still runs."""

    def shutdown(self, timeout_s: float) -> None:
        """Ask the loop to stop and wait for it (then force it, for a process)."""


# ----------------------------------------------------------------------------------------
# In-process: a thread
# ----------------------------------------------------------------------------------------
class _ThreadChannel:
    """The core's end in thread mode: a command queue in, a callback out."""

    def __init__(self, commands: queue.SimpleQueue, on_message: OnMessage) -> None:
        self._commands = commands
        self._on_message = on_message

    def get(self, block: bool) -> Optional[EngineCommand]:
        try:
            return self._commands.get(block=block)
        except queue.Empty:
            return None

    def put(self, message: CoreMessage) -> None:
        self._on_message(message)


class ThreadTransport:
    """Builds the core and runs ``core.run`` in one daemon thread of this process (``--no-engine-process``).

    NOTE: the build runs in the loop's thread, not the caller's: building runs torch's parallel CPU ops
    (weight packing), and GNU OpenMP keeps one worker pool per thread that ever ran one. A second pool
    (the caller's, idle) makes OpenMP count more threads than CPUs and then it sleeps and wakes its workers
    around every parallel region (the cost: benchmarks/RESULTS.md, "What sets the CPU defaults").
    """

    def __init__(self, build: Callable[[], EngineCore]) -> None:
        """Run ``build`` in the engine thread and wait for it; its exception is raised here."""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._start: queue.SimpleQueue = queue.SimpleQueue()     # on_message, or None: stop unstarted
        self._built = threading.Event()
        self._build_error: Optional[BaseException] = None
        self._started = False
        self._thread = threading.Thread(target=self._main, args=(build,), name="chorus-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        self.facts = self.core.facts

    def _main(self, build: Callable[[], EngineCore]) -> None:
        try:
            self.core = build()
        except BaseException as e:                  # handed to the constructor's caller
            self._build_error = e
            return
        finally:
            self._built.set()
        on_message = self._start.get()
        try:
            if on_message is not None:
                self.core.run(_ThreadChannel(self._commands, on_message))
        finally:   # the loop is over (shut down, or dead): the model and its caches go with it
            self.core.close()

    def start(self, on_message: OnMessage) -> None:
        self._started = True
        self._start.put(on_message)

    def send(self, command: EngineCommand) -> None:
        self._commands.put(command)

    def is_alive(self) -> bool:
        return self._started and self._thread.is_alive()

    def shutdown(self, timeout_s: float) -> None:
        """Stop the loop and join the engine thread, which closes the core (``EngineCore.close``)."""
        if not self._started:
            self._start.put(None)                   # a built core that never ran: let the thread end
        elif self._thread.is_alive():
            self._commands.put(Shutdown())
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)


# ----------------------------------------------------------------------------------------
# A process of its own
# ----------------------------------------------------------------------------------------
class _ProcessChannel:
    """The core's end in the engine process: two multiprocessing queues."""

    def __init__(self, commands: "mp.Queue", messages: "mp.Queue") -> None:
        self._commands = commands
        self._messages = messages
        self._parent = os.getppid()

    def get(self, block: bool) -> Optional[EngineCommand]:
        while True:
            try:
                return self._commands.get(block=block, timeout=_POLL_S if block else None)
            except queue.Empty:
                if not block:
                    return None
                if os.getppid() != self._parent:
                    return Shutdown()   # the API process died without a word (SIGKILL): do not linger

    def put(self, message: CoreMessage) -> None:
        if isinstance(message, (CallResult, EngineCoreOutputs)):
            message = _portable_errors(message)
        self._messages.put(message)


def run_engine_process(engine_kwargs: dict, commands: "mp.Queue", messages: "mp.Queue") -> None:
    """Entry point of the engine process: build the core, report ready, run the loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        from engine.arg_utils import EngineArgs
        core = EngineCore.from_engine_args(EngineArgs.from_kwargs(**engine_kwargs))
        ready = EngineReady(core.facts)
        pickle.dumps(ready)   # here, not in the queue's feeder thread, which would only print the error
        messages.put(ready)
    except BaseException as e:  # noqa: BLE001 - start-up errors go to the parent, which raises them
        messages.put(EngineStartupFailed(f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    core.run(_ProcessChannel(commands, messages))


class ProcessTransport:
    """Starts the engine in a child process (``spawn``: CUDA cannot be forked) and talks to it.

    Args:
        engine_kwargs: ``EngineArgs`` fields (pickled to the child).
        startup_timeout_s: how long to wait for the model to load.

    Raises:
        EngineStartupError: the engine failed to start (its message and traceback included).
    """

    def __init__(self, engine_kwargs: dict, startup_timeout_s: float = 1800.0) -> None:
        ctx = mp.get_context("spawn")
        self._commands = ctx.Queue()
        self._messages = ctx.Queue()
        self.proc = ctx.Process(target=run_engine_process,
                                args=(engine_kwargs, self._commands, self._messages),
                                name="chorus-engine-core", daemon=True)
        self.proc.start()
        self._receiver: Optional[threading.Thread] = None
        self._dead = threading.Event()
        self.facts = self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> EngineFacts:
        waited = 0.0
        while True:
            try:
                message = self._messages.get(timeout=_POLL_S)
                break
            except queue.Empty:
                waited += _POLL_S
                if not self.proc.is_alive():
                    raise EngineStartupError(f"The engine process exited during start-up "
                                             f"(exit code {self.proc.exitcode}).") from None
                if waited > timeout_s:
                    self.proc.kill()
                    raise EngineStartupError(f"The engine did not start within {timeout_s:.0f} s.") from None
        if isinstance(message, EngineStartupFailed):
            self.proc.join(5)
            raise EngineStartupError(f"The engine failed to start: {message.message}\n{message.traceback}")
        return message.facts

    def start(self, on_message: OnMessage) -> None:
        self._receiver = threading.Thread(target=self._receive, args=(on_message,),
                                          name="chorus-engine-client", daemon=True)
        self._receiver.start()

    def send(self, command: EngineCommand) -> None:
        if not self._dead.is_set():
            try:
                self._commands.put(command)
            except ValueError:                      # closed by ``shutdown`` meanwhile
                pass

    def is_alive(self) -> bool:
        return not self._dead.is_set() and self.proc.is_alive()

    def shutdown(self, timeout_s: float) -> None:
        """Stop the engine process (a ``Shutdown``, then SIGTERM after ``timeout_s``), then join the
        receiver thread and the command queue's feeder thread. Idempotent."""
        if self.proc.is_alive():
            try:
                self._commands.put(Shutdown())
            except (ValueError, OSError):
                pass
            self.proc.join(timeout_s)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(5)
        self._dead.set()
        if self._receiver is not None and self._receiver is not threading.current_thread():
            self._receiver.join()                   # it sees ``_dead`` within a poll
        self._commands.close()                      # the child is gone: nothing left to flush to it
        self._commands.join_thread()

    def _receive(self, on_message: OnMessage) -> None:
        """Receiver thread: blocks on the message queue (the GIL is free meanwhile)."""
        while not self._dead.is_set():
            try:
                message = self._messages.get(timeout=_POLL_S)
            except queue.Empty:
                if not self.proc.is_alive():
                    message = EngineDead(f"The engine process exited (exit code {self.proc.exitcode}).")
                else:
                    continue
            except Exception as e:  # noqa: BLE001 - a closed or broken queue: the link is gone
                message = EngineDead(f"Lost the engine process: {e!r}")
            if isinstance(message, EngineDead):
                self._dead.set()
            on_message(message)


def _portable_errors(message: CallResult | EngineCoreOutputs) -> CallResult | EngineCoreOutputs:
    """Errors that do not survive pickling become RuntimeErrors carrying their type and message
    (ours do survive: ValueError and the LoRA errors keep their 4xx mapping)."""
    if isinstance(message, CallResult):
        if message.error is not None:
            message.error = _portable(message.error)
    else:
        message.rejected = {rid: _portable(e) for rid, e in message.rejected.items()}
        message.failed = {rid: _portable(e) for rid, e in message.failed.items()}
    return message


def _portable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - e.g. an exception class with a custom __init__
        return RuntimeError(f"{type(error).__name__}: {error}")
