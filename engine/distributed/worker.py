"""The process of tensor-parallel rank 1..N-1: build its shard (``build_rank``), then run every step
rank 0 broadcasts on it, until told to stop.

    worker_main(spec, reports):
        join the group (env:// rendezvous)            # rank 0 joins too, in EngineCore.from_engine_args
        build_rank(...) -> report "built" -> agree on KV blocks -> report "ready"
        repeat: step = broadcast from rank 0
                apply its adapter commands; if step.shutdown: stop
                runner.execute(step.scheduler_output)   # same sampling as rank 0; the output is dropped
                    (constrained rows: rank 0's grammar bitmask is broadcast between forward and sampling)

Any exception ends the process with exit code 1 after its report (start-up) or log line (steps),
which closes its sockets: rank 0's pending collective fails at once (gloo) or at the group's timeout
(NCCL), and rank 0's watchdog reports the exit (``engine.distributed.executor``).
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from engine.arg_utils import EngineArgs
from engine.distributed.messages import AddAdapter, RemoveAdapter, WorkerReport, WorkerStep

logger = logging.getLogger("chorus.distributed.worker")


@dataclass
class WorkerSpec:
    """What a spawned rank needs to join the group and build its shard (pickled to the child)."""

    rank: int
    """This worker's rank, 1 .. size - 1."""
    size: int
    """tensor_parallel_size."""
    engine_args: EngineArgs
    """The engine's arguments, as rank 0 got them."""
    master_addr: str
    """Rendezvous host (env:// MASTER_ADDR)."""
    master_port: int
    """Rendezvous port (env:// MASTER_PORT)."""
    num_threads: int
    """torch intra-op threads on CPU (the cores divided among the ranks); 0: torch's default."""


def worker_main(spec: WorkerSpec, reports: Any) -> None:
    """Entry point of a worker process (``torch.multiprocessing`` spawn context)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the engine process owns shutdown
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s rank{spec.rank} %(name)s: %(message)s")
    from engine.distributed.group import destroy_tensor_parallel, init_tensor_parallel
    from engine.distributed.rank import build_rank
    from engine.device import resolve_device

    stage = "joining the process group"
    try:
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        device = resolve_device(spec.engine_args.create_engine_config().device)
        if device.type == "cuda":
            device = torch.device("cuda", spec.rank)
        timeout_s = spec.engine_args.create_engine_config().parallel_config.distributed_timeout_s
        group = init_tensor_parallel(spec.rank, spec.size, device, timeout_s, spec.master_addr, spec.master_port)
        stage = "building its model shard"
        parts = build_rank(spec.engine_args, device, group, on_built=lambda: reports.put(
            WorkerReport(spec.rank, "built")))
        reports.put(WorkerReport(spec.rank, "ready"))
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which raises it naming this rank
        _exit_with(reports, WorkerReport(spec.rank, "failed", f"{stage}: {type(e).__name__}: {e}\n"
                                                              f"{traceback.format_exc()}"))
    try:
        run_worker_loop(group, parts.runner, parts.lora_manager)
    except BaseException as e:  # noqa: BLE001 - any escape ends this rank; rank 0's watchdog notices the exit
        logger.exception("Tensor-parallel rank %d failed; exiting (the engine stops).", spec.rank)
        _exit_with(reports, WorkerReport(spec.rank, "failed", f"running a step: {type(e).__name__}: {e}"))
    destroy_tensor_parallel(group)


def _exit_with(reports: Any, report: WorkerReport) -> None:
    """Send the last report (flushed: the queue's feeder thread would die with the process) and exit 1
    without running the interpreter's cleanup (which could block on the broken process group)."""
    reports.put(report)
    reports.close()
    reports.join_thread()
    os._exit(1)


def run_worker_loop(group, runner, lora_manager) -> None:
    """Run rank 0's broadcast steps until a shutdown step."""
    while True:
        step: WorkerStep = group.broadcast_object()
        for command in step.adapter_commands:
            if isinstance(command, AddAdapter):
                lora_manager.register(command.lora_request, keep_if_removing=True)
            elif isinstance(command, RemoveAdapter):
                lora_manager.remove(command.lora_name)
        if step.shutdown:
            return
        so = step.scheduler_output
        if so is not None:
            runner.execute(so, _rank0_grammar_bitmask(group) if so.structured_output_req_ids else None)


def _rank0_grammar_bitmask(group):
    """A worker's ``GrammarSource``: the bitmask rank 0 broadcasts when its runner asks for it (each
    rank's runner asks at the same point of the step)."""
    return lambda _sample_req_ids: group.broadcast_object()
