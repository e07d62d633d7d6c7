"""Failures at tensor_parallel_size 2: a worker killed mid-generation stops the engine within a bounded
time (no hang on a collective), start-up failures name the rank and the cause, and models or sizes that
cannot be sharded are refused before any worker starts."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from typing import Iterator

import pytest

from engine.arg_utils import EngineArgs
from engine.core_messages import AddRequest, EngineCoreOutputs, EngineDead, Shutdown
from engine.engine_core import EngineCore
from engine.errors import EngineDeadError, EngineStartupError
from engine.sampling_params import SamplingParams

DEAD_WITHIN_S = 15.0
"""Bound on the time from the worker's death to ``EngineDead`` (gloo fails the pending collective as
soon as the peer's sockets close; the watchdog polls every 0.2 s)."""


class QueueChannel:
    """The core's end of a transport for tests: commands from a queue, messages into a list."""

    def __init__(self) -> None:
        self.commands: queue.Queue = queue.Queue()
        self.messages: list = []
        self.dead = threading.Event()

    def get(self, block: bool):
        try:
            return self.commands.get(block=block, timeout=None if block else 0)
        except queue.Empty:
            return None

    def put(self, message) -> None:
        self.messages.append(message)
        if isinstance(message, EngineDead):
            self.dead.set()


@contextlib.contextmanager
def running_tp2_core(model_dir) -> Iterator[tuple[EngineCore, QueueChannel]]:
    """A tensor_parallel_size 2 core whose loop runs in a thread; on exit: Shutdown, and the loop must end."""
    core = EngineCore.from_engine_args(EngineArgs(model=str(model_dir), device="cpu", dtype="float32",
                                                  max_model_len=256, num_gpu_blocks_override=64,
                                                  tensor_parallel_size=2))
    channel = QueueChannel()
    loop = threading.Thread(target=core.run, args=(channel,), daemon=True)
    loop.start()
    try:
        yield core, channel
    finally:
        channel.commands.put(Shutdown())
        loop.join(30)
    assert not loop.is_alive(), "the engine loop hung"
    assert not any(p.is_alive() for p in core.executor.procs)


def test_killed_worker_stops_the_engine(tiny_llama_dir):
    with running_tp2_core(tiny_llama_dir) as (core, channel):
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        _, children = core.facts.processor.process("r0", "The quick brown fox", params, None, 0, None, None)
        channel.commands.put(AddRequest("r0", children))
        deadline = time.monotonic() + 30
        while not any(isinstance(m, EngineCoreOutputs) and m.outputs for m in channel.messages):
            assert time.monotonic() < deadline, "no step ran"
            time.sleep(0.01)
        os.kill(core.executor.procs[0].pid, signal.SIGKILL)                  # mid-generation
        killed_at = time.monotonic()
        assert channel.dead.wait(DEAD_WITHIN_S), "the engine did not report EngineDead"
        assert time.monotonic() - killed_at < DEAD_WITHIN_S
        with pytest.raises(EngineDeadError):
            core.step()
    assert sum(isinstance(m, EngineDead) for m in channel.messages) == 1


def test_worker_dying_while_idle_makes_the_engine_dead(tiny_llama_dir):
    """No step runs, so no collective fails: the watchdog reports the death (rank, exit code)."""
    with running_tp2_core(tiny_llama_dir) as (core, channel):
        os.kill(core.executor.procs[0].pid, signal.SIGKILL)
        assert channel.dead.wait(DEAD_WITHIN_S), "the engine did not report EngineDead"
        dead = [m for m in channel.messages if isinstance(m, EngineDead)]
        assert "rank 1" in dead[0].message and "exited with code -9" in dead[0].message


class _FakeProc:
    pid, exitcode = 12345, None

    def is_alive(self) -> bool:
        return True


def test_startup_failure_names_the_rank_and_cause():
    from engine.distributed.executor import TensorParallelExecutor
    from engine.distributed.group import TensorParallelGroup
    from engine.distributed.messages import WorkerReport

    reports = queue.Queue()
    executor = TensorParallelExecutor(TensorParallelGroup(rank=0, size=3), None, [_FakeProc(), _FakeProc()], reports)
    reports.put(WorkerReport(1, "built"))
    reports.put(WorkerReport(2, "failed", "building its model shard: OSError: model.safetensors is truncated"))
    with pytest.raises(EngineStartupError, match=r"rank 2 failed while building its model shard: OSError: "
                                                 r"model.safetensors is truncated"):
        executor.wait_built()


def test_unshardable_settings_are_refused_before_spawning(tiny_llama_dir):
    """Heads that 3 ranks cannot split: a ValueError saying which sizes work, in well under a second
    (no worker process is started)."""
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"not divisible by --tensor-parallel-size 3.*\[1, 2, 4\]"):
        EngineCore.from_engine_args(EngineArgs(model=str(tiny_llama_dir), device="cpu", tensor_parallel_size=3))
    with pytest.raises(ValueError, match="--quantization int8 with --tensor-parallel-size 2"):
        EngineCore.from_engine_args(EngineArgs(model=str(tiny_llama_dir), device="cpu", quantization="int8",
                                               tensor_parallel_size=2))
    assert time.monotonic() - started < 5

