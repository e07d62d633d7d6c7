"""``AdapterLoader``: the engine's disk reads of adapters, on a thread beside the step loop.

The engine reads an adapter itself in two cases: its host store (``max_cpu_loras`` adapters)
dropped a registered adapter that a waiting request needs in a slot again, or a request names an
adapter the engine was never sent (the client's record of sent adapters was out of date). Either
way the step loop only asks for the read (``request``) and goes on stepping the other requests;
the scheduler leaves the waiting requests unscheduled until the loop takes the result
(``take_done``) and puts the adapter in the store. Weights the client sent (``adopt``) take the same
path on a CUDA engine, where the thread page-locks them: that copy never runs on the step loop.

Up to ``num_threads`` reads run at once (safetensors reads, the scale folding and page-locking release
the GIL), so a burst of requests naming many cold adapters is not read one adapter at a time. The threads
exist only while reads are queued: they start with the reads and end when the queue is empty, so an idle or
closed engine holds no loader thread.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Union

from lora.adapter_reader import AdapterReader
from lora.errors import LoRAAdapterError
from lora.peft_adapter import LoRAAdapter
from lora.request import LoRARequest

logger = logging.getLogger("chorus.lora")


@dataclass
class AdapterRead:
    """One finished read."""

    lora_request: LoRARequest
    """The adapter asked for (name and path)."""
    result: Union[LoRAAdapter, LoRAAdapterError]
    """Its weights, or why they could not be read."""


@dataclass
class ReadTotals:
    """What the loader's reads took since start (summed over reads; failed reads included)."""

    num_reads: int = 0
    """Reads finished."""
    nbytes: int = 0
    """Bytes of the weights they returned."""
    read_s: float = 0.0
    """Seconds on a thread per read (file to prepared tensors, page-locked with ``pin_memory``)."""
    queued_s: float = 0.0
    """Seconds each read waited for a thread."""


class AdapterLoader:
    """Reads adapters on a thread of its own; the engine's loop asks and collects (thread-safe).

    Args:
        reader: reads an adapter for the engine's base model.
        pin_memory: page-lock each adapter read, on the loader thread (CUDA engines: the host store keeps
            pinned copies, and pinning on the step loop would be a host copy there).
        num_threads: reads that may run at once.
    """

    def __init__(self, reader: AdapterReader, pin_memory: bool = False, num_threads: int = 4) -> None:
        if num_threads < 1:
            raise ValueError(f"AdapterLoader needs num_threads >= 1, got {num_threads}.")
        self.reader = reader
        self.pin_memory = pin_memory
        self.num_threads = num_threads
        self._queued: dict[str, LoRARequest] = {}
        """Adapter name -> the read asked for and not finished (queued or running); with weights: adopted."""
        self._queued_at: dict[str, float] = {}
        """Adapter name -> ``time.perf_counter()`` when its read was queued (while in ``_queued``)."""
        self.totals = ReadTotals()
        """What the finished reads took (``read_totals``)."""
        self._running: set[str] = set()
        """Names in ``_queued`` a thread is reading now."""
        self._done: list[AdapterRead] = []
        """Finished reads the loop has not taken yet."""
        self._lock = threading.Lock()
        self._finished = threading.Condition(self._lock)
        """Notified after each read."""
        self._threads: list[threading.Thread] = []
        """The reading threads while reads are queued."""

    def request(self, lora_request: LoRARequest) -> None:
        """Read this adapter (once while a read of that name is queued or not yet taken)."""
        self._queue(lora_request.without_adapter())

    def adopt(self, lora_request: LoRARequest) -> None:
        """Take the weights ``lora_request.adapter`` carries (the client read them) as this adapter's read,
        page-locked on the thread with ``pin_memory``."""
        if lora_request.adapter is None:
            raise ValueError(f"adopt({lora_request.lora_name!r}) needs the weights the client read.")
        self._queue(lora_request)

    def _queue(self, lora_request: LoRARequest) -> None:
        name = lora_request.lora_name
        with self._lock:
            if name in self._queued or any(d.lora_request.lora_name == name for d in self._done):
                return
            self._queued[name] = lora_request
            self._queued_at[name] = time.perf_counter()
            if len(self._threads) < min(self.num_threads, len(self._queued)):
                thread = threading.Thread(target=self._run, name="chorus-adapter-loader", daemon=True)
                self._threads.append(thread)
                thread.start()

    @property
    def num_pending(self) -> int:
        """Reads queued or running (not finished)."""
        with self._lock:
            return len(self._queued)

    @property
    def busy(self) -> bool:
        """Reads are queued, running, or finished and not taken."""
        with self._lock:
            return bool(self._queued or self._done)

    def read_totals(self) -> ReadTotals:
        """A copy of what the finished reads took since start."""
        with self._lock:
            return replace(self.totals)

    def take_done(self) -> list[AdapterRead]:
        """The reads finished since the last call."""
        with self._lock:
            done, self._done = self._done, []
            return done

    def wait(self, timeout_s: float) -> None:
        """Block until a read finishes (or one is there to take), at most ``timeout_s``."""
        with self._lock:
            if not self._done and self._queued:
                self._finished.wait(timeout_s)

    def _run(self) -> None:
        while True:
            with self._lock:
                name = next((n for n in self._queued if n not in self._running), None)
                if name is None:
                    self._threads.remove(threading.current_thread())
                    return
                self._running.add(name)
                lora_request = self._queued[name]
                started = time.perf_counter()
                queued_s = started - self._queued_at[name]
            try:
                result: Union[LoRAAdapter, LoRAAdapterError] = (
                    lora_request.adapter if lora_request.adapter is not None
                    else self.reader.read(lora_request, pin_memory=True) if self.pin_memory
                    else self.reader.read(lora_request))
                if self.pin_memory:
                    result.pin_memory()
            except LoRAAdapterError as e:
                result = e
            except Exception as e:  # noqa: BLE001 - an unreadable adapter fails its requests, not the engine
                logger.exception("Reading LoRA adapter %r failed.", name)
                result = LoRAAdapterError(f"LoRA adapter {name!r} could not be read ({type(e).__name__}).")
            read_s = time.perf_counter() - started
            with self._lock:
                self._queued.pop(name, None)
                self._queued_at.pop(name, None)
                self._running.discard(name)
                t = self.totals
                t.num_reads, t.read_s, t.queued_s = t.num_reads + 1, t.read_s + read_s, t.queued_s + queued_s
                t.nbytes += result.nbytes() if isinstance(result, LoRAAdapter) else 0
                self._done.append(AdapterRead(lora_request.without_adapter(), result))
                self._finished.notify_all()
