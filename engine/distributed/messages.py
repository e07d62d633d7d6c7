"""What rank 0 tells the other ranks, once per step (one ``broadcast_object_list`` on the gloo group),
and what the worker processes report while they start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from engine.outputs import SchedulerOutput
from lora.request import LoRARequest


@dataclass
class AddAdapter:
    """Register an adapter on this rank (read and keep its shard in the host store)."""

    lora_request: LoRARequest
    """The adapter rank 0 registered (same name, id and path)."""


@dataclass
class RemoveAdapter:
    """Free an adapter on this rank: its slot, host copy and registration."""

    lora_name: str
    """The adapter rank 0 removed."""


AdapterCommand = AddAdapter | RemoveAdapter


@dataclass
class WorkerStep:
    """One broadcast from rank 0: adapter changes since the last one, then a step to run (or stop)."""

    adapter_commands: list[AdapterCommand] = field(default_factory=list)
    """Applied in order before the step (a remove then an add of one name stay in that order)."""
    scheduler_output: Optional[SchedulerOutput] = None
    """The step every rank runs with ``ModelRunner.execute``; None: adapter commands only."""
    shutdown: bool = False
    """Leave the loop and the process group, then exit."""


@dataclass
class WorkerReport:
    """A worker's start-up progress or failure, sent over a multiprocessing queue to rank 0."""

    rank: int
    """The reporting rank (1 .. size - 1)."""
    stage: str
    """"built" (model and runner built), "ready" (KV cache allocated, entering the loop) or "failed"."""
    error: Optional[str] = None
    """With "failed": the exception, "Type: message", and the traceback after it."""
