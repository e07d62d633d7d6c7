"""Rank 0's side of tensor parallelism, as vLLM's multiprocess executor: spawn ranks 1..N-1, form the
group with them, send each step to them, and watch that they live.

    EngineCore (rank 0)                         worker processes (ranks 1..N-1)
    -------------------                         -------------------------------
    TensorParallelExecutor.start()  --spawn-->  worker_main: join group, build_rank
    build_rank (own shard) ........ "built" ... wait_built(): every worker built, or its error
    min KV blocks (collective) ........................ min KV blocks
    wait_ready()
    each step: send_step(so)  --broadcast-->    run_worker_loop: execute(so)
               runner.execute(so)  <== all-reduce / all-gather in every layer ==>
               (constrained rows: send_grammar_bitmask  --broadcast-->  after the forward, before sampling)
    close(): WorkerStep(shutdown=True), join

Failure: a worker that raises reports it and exits; a killed one just exits. The watchdog thread
polls the processes (``WATCHDOG_POLL_S``) and calls ``on_death`` with the rank, exit code and cause,
so an idle engine reports itself dead too; a step in flight fails at once on gloo (the peer's
sockets close) or after ``ParallelConfig.distributed_timeout_s`` on NCCL. ``send_step`` refuses to
enter a collective once a worker is known dead.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional

import torch

import engine.envs as envs
from engine.arg_utils import EngineArgs
from engine.config import ParallelConfig
from engine.distributed.group import TensorParallelGroup, destroy_tensor_parallel
from engine.distributed.group import free_port, init_tensor_parallel, require_no_process_group
from engine.distributed.messages import AddAdapter, AdapterCommand, RemoveAdapter, WorkerReport, WorkerStep
from engine.distributed.worker import WorkerSpec, worker_main
from engine.errors import EngineDeadError, EngineStartupError
from engine.outputs import SchedulerOutput

if TYPE_CHECKING:
    from engine.structured_output.manager import GrammarBitmask

logger = logging.getLogger("chorus.distributed")

WATCHDOG_POLL_S = 0.2
"""How often the watchdog checks the worker processes."""
STARTUP_TIMEOUT_S = 1800.0
"""Longest wait for the workers to build their shards (large checkpoints read from slow disks)."""
SHUTDOWN_JOIN_S = 5.0
"""How long ``close`` waits for the workers to exit before terminating them."""


@contextlib.contextmanager
def _children_allowed():
    """Let a daemonic process (the engine process of ``chorus serve --engine-process``) start workers.

    NOTE: multiprocessing refuses children of daemonic processes so that they are not orphaned; ours
    are daemonic themselves and exit when rank 0's sockets close, and ``close`` / atexit join them.
    """
    proc = multiprocessing.current_process()
    daemon = proc._config.get("daemon", False)
    proc._config["daemon"] = False
    try:
        yield
    finally:
        proc._config["daemon"] = daemon


def cpu_threads_per_rank(size: int) -> int:
    """torch threads for each rank on CPU: CHORUS_NUM_THREADS when set, else the cores divided among the
    ranks (>= 1)."""
    if envs.num_threads():
        return envs.num_threads()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // size)


class TensorParallelExecutor:
    """Rank 0's handle on the worker ranks (built by ``start``)."""

    def __init__(self, group: TensorParallelGroup, device: torch.device, procs: list,
                 reports: "multiprocessing.Queue") -> None:
        self.group = group
        """Rank 0's group (the broadcasts and rank 0's collectives go through it)."""
        self.device = device
        """Rank 0's device (cuda:0 on CUDA)."""
        self.procs = procs
        """The worker processes, index i holding rank i + 1."""
        self._reports = reports
        self._pending: list[AdapterCommand] = []
        """Adapter commands for the next broadcast."""
        self._adapters_sent: set[str] = set()
        """Adapters the workers were told to register (and not to remove since)."""
        self._dead_reason: Optional[str] = None
        """Why the engine cannot run steps any more (a worker died); None while healthy."""
        self._closed = False
        self._serving = False
        """Every worker is in its step loop (``wait_ready`` returned): a shutdown broadcast reaches them;
        before that they may wait in a start-up collective, and are terminated instead."""
        self.on_death: Optional[Callable[[str], None]] = None
        """Called once, from the watchdog thread, when a worker dies while the engine runs."""
        self._watchdog: Optional[threading.Thread] = None
        self._prev_num_threads = torch.get_num_threads()
        """This process's torch threads before ``start`` divided the cores (restored by ``close``)."""

    # ------------------------------------------------------------------ start-up
    @classmethod
    def start(cls, engine_args: EngineArgs, parallel_config: ParallelConfig, device: torch.device
              ) -> "TensorParallelExecutor":
        """Spawn ranks 1..N-1 and form the group (env:// rendezvous on MASTER_ADDR / MASTER_PORT, taken
        from the environment when set, as under torchrun, else localhost and a free port)."""
        size = parallel_config.tensor_parallel_size
        try:
            require_no_process_group()   # before any worker starts
        except RuntimeError as e:
            raise EngineStartupError(str(e)) from None
        if device.type == "cuda":
            parallel_config.check_devices("cuda", torch.cuda.device_count())
            device = torch.device("cuda", 0)
        threads = cpu_threads_per_rank(size) if device.type == "cpu" else 0
        addr, port = envs.rendezvous()
        addr, port = addr or "127.0.0.1", port or free_port()
        ctx = torch.multiprocessing.get_context("spawn")
        reports = ctx.Queue()
        procs = []
        with _children_allowed():
            for rank in range(1, size):
                spec = WorkerSpec(rank, size, engine_args, addr, port, threads)
                proc = ctx.Process(target=worker_main, args=(spec, reports), name=f"chorus-tp-rank{rank}",
                                   daemon=True)
                proc.start()
                procs.append(proc)
        logger.info("Tensor parallelism: %d ranks (%s), rendezvous on %s:%d", size,
                    "NCCL" if device.type == "cuda" else "gloo", addr, port)
        executor = cls(TensorParallelGroup.single(), device, procs, reports)
        if threads:
            torch.set_num_threads(threads)   # rank 0 shares the cores with the workers
        atexit.register(executor.close)
        try:
            executor.group = executor._join(lambda: init_tensor_parallel(
                0, size, device, parallel_config.distributed_timeout_s, addr, port))
        except BaseException:
            executor.close()
            raise
        return executor

    def _join(self, init: Callable[[], TensorParallelGroup]) -> TensorParallelGroup:
        """Run rank 0's rendezvous while watching the workers (one that fails first is named, not waited for)."""
        result: dict = {}

        def target() -> None:
            try:
                result["group"] = init()
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller's thread
                result["error"] = e

        thread = threading.Thread(target=target, name="chorus-tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(WATCHDOG_POLL_S)
            self._raise_startup_failure()
        if "error" in result:
            raise EngineStartupError(f"Tensor-parallel rank 0 could not join the process group: "
                                     f"{type(result['error']).__name__}: {result['error']}") from result["error"]
        return result["group"]

    def wait_built(self) -> None:
        """Block until every worker built its shard; EngineStartupError naming the rank that failed."""
        self._wait_for("built")

    def wait_ready(self) -> None:
        """Block until every worker allocated its KV cache; then start the watchdog."""
        self._wait_for("ready")
        self._serving = True
        self._watchdog = threading.Thread(target=self._watch, name="chorus-tp-watchdog", daemon=True)
        self._watchdog.start()

    def _wait_for(self, stage: str) -> None:
        waiting = set(range(1, self.group.size))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while waiting:
            report = self._next_report(WATCHDOG_POLL_S)
            if report is not None:
                if report.stage == "failed":
                    raise EngineStartupError(f"Tensor-parallel rank {report.rank} failed while {report.error}")
                if report.stage == stage:
                    waiting.discard(report.rank)
                continue
            self._raise_startup_failure()
            if time.monotonic() > deadline:
                raise EngineStartupError(f"Tensor-parallel ranks {sorted(waiting)} did not get {stage} within "
                                         f"{STARTUP_TIMEOUT_S:.0f} s.")

    def _raise_startup_failure(self) -> None:
        report = self._next_report(0)
        if report is not None and report.stage == "failed":
            raise EngineStartupError(f"Tensor-parallel rank {report.rank} failed while {report.error}")
        if report is not None:
            self._reports.put(report)   # not ours to consume here
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                report = self._next_report(1.0)   # its last words, if it had time for them
                cause = f": {report.error}" if report is not None and report.stage == "failed" else ""
                raise EngineStartupError(f"Tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                                         f"{proc.exitcode} during start-up{cause}")

    def _next_report(self, timeout_s: float) -> Optional[WorkerReport]:
        try:
            return self._reports.get(timeout=timeout_s) if timeout_s > 0 else self._reports.get_nowait()
        except queue.Empty:
            return None

    # ------------------------------------------------------------------ steps
    def add_adapter(self, lora_request) -> None:
        """Register ``lora_request`` on every worker with the next broadcast (once per name until it is
        removed: the engine calls this for every request naming an adapter)."""
        if lora_request.lora_name in self._adapters_sent:
            return
        self._adapters_sent.add(lora_request.lora_name)
        self._pending.append(AddAdapter(lora_request))

    def remove_adapter(self, lora_name: str) -> None:
        """Remove the adapter on every worker (with the next broadcast)."""
        self._adapters_sent.discard(lora_name)
        self._pending.append(RemoveAdapter(lora_name))

    def send_step(self, so: SchedulerOutput) -> None:
        """Broadcast the step (and the adapter commands queued before it) to every worker, which then
        runs it with rank 0. EngineDeadError without any collective once a worker is known dead."""
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        step = WorkerStep(self._pending, so)
        self._pending = []
        self.group.broadcast_object(step)

    def send_grammar_bitmask(self, bitmask: Optional["GrammarBitmask"]) -> None:
        """Broadcast the grammar bitmask of the step being run (rank 0's runner asked for it once its
        forward was launched; each worker's runner asks at the same point: ``run_worker_loop``). Sent as a
        copy of its rows (it is a view of the manager's whole buffer)."""
        if bitmask is not None:
            bitmask = dataclasses.replace(bitmask, bitmask=bitmask.bitmask.clone())
        self.group.broadcast_object(bitmask)

    @property
    def dead_reason(self) -> Optional[str]:
        """Why the workers cannot run steps any more; None while they all live."""
        return self._dead_reason

    # ------------------------------------------------------------------ health, shutdown
    def _watch(self) -> None:
        while not self._closed:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.is_alive() or self._closed:
                    continue
                report = self._next_report(0.5)
                cause = f": {report.error.splitlines()[0]}" if report is not None and report.error else ""
                self._dead_reason = (f"Tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                                     f"{proc.exitcode}{cause}; the engine stops.")
                logger.error(self._dead_reason)
                if self.on_death is not None:
                    self.on_death(self._dead_reason)
                return
            time.sleep(WATCHDOG_POLL_S)

    def close(self, graceful: bool = True) -> None:
        """Stop the workers and leave the group. ``graceful``: a shutdown broadcast while they all wait
        for the next step; otherwise (a step failed half-way, so a worker may wait in a collective that
        a broadcast would not match) they are terminated. Idempotent; also registered with atexit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        alive = all(p.is_alive() for p in self.procs)
        if graceful and alive and self._serving and self._dead_reason is None:
            try:
                self.group.broadcast_object(WorkerStep(self._pending, None, shutdown=True))
            except Exception as e:  # noqa: BLE001 - a broken group: terminate below
                logger.warning("Tensor parallelism: shutdown broadcast failed (%s); terminating workers.", e)
        for proc in self.procs:
            proc.join(SHUTDOWN_JOIN_S if alive else 0.1)
            if proc.is_alive():
                proc.terminate()
                proc.join(SHUTDOWN_JOIN_S)
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join()   # it sees ``_closed`` within a poll
        destroy_tensor_parallel(self.group)
        torch.set_num_threads(self._prev_num_threads)
        close_queue = getattr(self._reports, "close", None)   # a multiprocessing queue: free its semaphores
        if close_queue is not None:
            close_queue()
            self._reports.join_thread()   # its feeder thread, if a put started one
