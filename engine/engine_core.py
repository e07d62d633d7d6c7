"""``EngineCore``: scheduler -> model runner -> scheduler update, one step at a time, and the one
engine loop that drains commands, steps and emits one ``EngineCoreOutputs`` per step.

The core deals in sequences and token ids only: the client (``AsyncLLM`` or the offline
``LLMEngine``) tokenizes, fans ``n > 1`` out, detokenizes, finds stop strings and builds
``RequestOutput``s. ``run(channel)`` is the loop; it runs in a thread of the API process or in a
process of its own (``engine/core_transport.py``), identical in both: only the ``CoreChannel``
differs. The offline ``LLMEngine`` calls ``step()`` directly, without a loop or a thread.

    run(channel):  repeat
        drain commands (block while idle): AddRequest / AbortRequests / CallEngine / InjectFault / Shutdown
        if work: step(); channel.put(EngineCoreOutputs(outputs of the step, stats, failed sequences))
        an exception escaping here: channel.put(EngineDead(...)), and the loop ends

Faults inside a step (README, "Failure behaviour"): a step that raises fails the sequences it ran
(with async scheduling, those of the launched step it completes too) with ``EngineStepError``, frees
their KV blocks (out of the prefix cache: their KV may be unwritten), encoder-cache entries and
adapter slots, and the engine goes on. ``MAX_CONSECUTIVE_STEP_FAULTS`` failed steps in a row, or one
CUDA error (the device context is unusable after it), stop the engine instead: the step's sequences
still get their ``EngineStepError``, then ``step()`` raises ``EngineDeadError`` (the loop reports
``EngineDead``: a 503, a failed ``/health``, and ``chorus serve`` exits non-zero).

With async scheduling (the default) each ``step()`` schedules and launches step N+1 before it
reads step N's sampled ids, so scheduling and the update of one step overlap the device's work
on the next.

Constrained decoding (``engine.structured_output``): the core builds one ``GrammarCompilePool`` (the
tokenizer, the logits width, ``--structured-outputs-backend``), shared by the processor (which validates a
request's constraint before it is queued: a 400 with the compiler's reason) and the scheduler's
``StructuredOutputManager``. A step that samples constrained requests needs their matchers to have taken
every earlier token. With async scheduling its sampling stays open after its forward is launched: the next
``step()`` schedules step N+1 and prepares its inputs, then the runner asks for step N's bitmask
(``_grammar_source``; step N-1 was settled in the previous ``step()``), samples N and launches N+1's forward
at once, and step N is settled while the device runs N+1. The host's bitmask work overlaps step N's
forward, and the device waits only for the bitmask itself, not for scheduling. Without async scheduling,
and with tensor parallelism, the bitmask is asked for once the forward is launched and first settles the
step in flight.

Tensor parallelism (``tensor_parallel_size`` > 1): this core is rank 0. ``from_engine_args`` starts
the other ranks (``engine.distributed.executor``), every rank builds its shard the same way
(``engine.distributed.rank.build_rank``), and ``_run`` broadcasts each step's ``SchedulerOutput`` (with
the adapter loads and unloads since the last one) before running it on rank 0's shard. Every step
fault is then fatal (the ranks cannot be assumed to be in step after it), and a worker's death makes
the engine dead even while idle.
"""

from __future__ import annotations

import atexit
import gc
import logging
import threading
from typing import Any, Iterable, Optional, Protocol

import torch

import engine.envs as envs
from engine.arg_utils import EngineArgs
from engine.config import EngineConfig
from engine.core_messages import (AbortRequests, AddLoRA, AddRequest, AlignmentScores, CallEngine, CallResult,
                                  CoreMessage, EngineCall, EngineCommand, EngineCoreOutputs, EngineDead, EngineFacts,
                                  GetStats, InjectFault, ListLoRAs, RemoveLoRA, ResetPrefixCache, Shutdown,
                                  refuse_non_call)
from engine.errors import EngineDeadError, EngineStepError
from engine.host_memory import keep_freed_host_memory, register_pinned_host_memory
from engine.distributed.group import TensorParallelGroup
from engine.device import resolve_device
from engine.distributed.rank import build_rank
from engine.models.builder import check_tensor_parallel
from engine.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SchedulerStats
from engine.processor import Processor
from engine.reasoning.engine_gate import ReasoningGate
from engine.reasoning.registry import get_reasoning_parser
from engine.request import Request, RequestStatus
from engine.runner.alignment import alignment_scores
from engine.runner.pending import PendingOutput
from engine.runner.runner import ModelRunner
from engine.runner.grammar_mask import GrammarSource
from engine.scheduler import Scheduler
from engine.structured_output.compiler import GrammarCompilePool
from engine.structured_output.manager import GrammarBitmask, StructuredOutputManager

logger = logging.getLogger("chorus.engine_core")

MAX_CONSECUTIVE_STEP_FAULTS = 3
"""Failed steps in a row after which the engine stops instead of recovering: a fault that repeats
is not confined to the requests it hit (a broken device, a bug in every step), and a restart is
what clears it."""

ADAPTER_READ_POLL_S = 0.05
"""Longest wait of a step that scheduled nothing for the loader thread's read of an adapter (the loop
takes new commands between waits)."""

GRAMMAR_COMPILE_POLL_S = 0.05
"""Longest wait of a step that scheduled nothing for a grammar being compiled (as ``ADAPTER_READ_POLL_S``)."""

_ACCELERATOR_ERRORS: tuple[type[BaseException], ...] = tuple(
    cls for cls in (getattr(torch, "AcceleratorError", None),) if cls is not None)
"""torch's type of a CUDA runtime error (``torch.AcceleratorError``: illegal memory access, device-side
assert, launch failure), after which the CUDA context cannot be used any more; empty on a torch
without it (before 2.8)."""
_CUDA_ERROR_MARKERS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side assert",
                       "illegal memory access", "unspecified launch failure")
"""Substrings of the messages of such errors where they come untyped: every CUDA error on a torch
without ``AcceleratorError``, and on any torch cuBLAS / cuDNN statuses (``RuntimeError`` through
``TORCH_CHECK``) and errors of Triton's launcher (``Triton Error [CUDA]: ...``)."""


def freeze_gc_heap() -> None:
    """Move everything allocated so far (model, tokenizer, imports: long-lived) out of the garbage
    collector's reach, so its full passes stop rescanning it (as vLLM does): otherwise every pass walks all
    of it, a cost paid in the client's per-token output processing. Unfrozen at exit, so finalizers still run."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)   # registered once, however often this runs
    atexit.register(gc.unfreeze)


class CoreChannel(Protocol):
    """The core's end of a transport: commands in, messages out (FIFO both ways)."""

    def get(self, block: bool) -> Optional[EngineCommand]:
        """The next command; None when there is none and ``block`` is False. A blocking get may
        return ``Shutdown()`` when the client is gone."""

    def put(self, message: CoreMessage) -> None:
        """Send one message to the client."""


class EngineCore:
    """Owns the model runner, the scheduler and the adapter manager; not thread-safe (one
    thread drives it: the loop's, or the offline caller's).

    Args:
        engine_config: the resolved configs.
        runner: executes ``SchedulerOutput``s (``execute`` / ``execute_async``).
        scheduler: the request scheduler, sized for the runner's KV cache.
        facts: what clients need (tokenizer, processor, names, limits).
        lora_manager: the adapter manager, when LoRA is enabled.
        executor: tensor parallelism (size > 1): rank 0's handle on the worker ranks
            (``engine.distributed.executor.TensorParallelExecutor``); None in a one-process engine.
    """

    def __init__(self, engine_config: EngineConfig, runner: ModelRunner, scheduler: Scheduler,
                 facts: EngineFacts, lora_manager=None, executor=None) -> None:
        self.engine_config = engine_config
        self.executor = executor
        self.runner = runner
        self.scheduler = scheduler
        self.facts = facts
        self.lora_manager = lora_manager
        self.async_scheduling = engine_config.scheduler_config.async_scheduling
        self._sample_with_next = self.async_scheduling and executor is None
        """A constrained step samples once the next step's inputs are prepared (``ModelRunner.execute_async``);
        the tensor-parallel workers sample each step as it runs."""
        self._in_flight: Optional[tuple[SchedulerOutput, PendingOutput]] = None
        """Async scheduling: the launched step whose output has not been processed yet."""
        self._failed: dict[str, BaseException] = {}
        """Sequences ended with an error since the last ``take_failed()`` (sequence id -> error)."""
        self._num_consecutive_faults = 0
        """Steps that raised in a row (0 after any step that did not)."""
        self._dead_error: Optional[EngineDeadError] = None
        """Set by a fatal step fault: every later ``step()`` / ``add_request`` raises it."""
        self._dead_sent = threading.Lock()
        """Held once ``EngineDead`` went out (by the loop or the tensor-parallel watchdog): it is sent once."""
        self._injected_fault: Optional[tuple[BaseException, int]] = None
        """Test hook (``inject_step_faults``): the error the next steps raise, and how many more do."""

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "EngineCore":
        """Load the model, size the KV cache, build the scheduler (minutes for large models)."""
        if envs.num_threads():
            torch.set_num_threads(envs.num_threads())
        probe = engine_args.create_engine_config()
        device = resolve_device(probe.device)
        if device.type == "cpu":
            keep_freed_host_memory()      # prompt steps reuse freed activations instead of faulting them in
        elif device.type == "cuda":
            register_pinned_host_memory()  # adapters page-locked faster than by cudaHostAlloc
        executor, tp = None, TensorParallelGroup.single()
        if probe.parallel_config.tensor_parallel_size > 1:
            # Checked before any worker starts: a model that cannot be sharded fails in a second.
            check_tensor_parallel(probe.model_config, probe.parallel_config)
            from engine.distributed.executor import TensorParallelExecutor
            executor = TensorParallelExecutor.start(engine_args, probe.parallel_config, device)
            tp, device = executor.group, executor.device
        try:
            parts = build_rank(engine_args, device, tp, on_built=executor.wait_built if executor else None)
            if executor is not None:
                executor.wait_ready()
        except BaseException:
            if executor is not None:
                executor.close()
            raise
        cfg, loaded, runner, lora_manager = parts.config, parts.loaded, parts.runner, parts.lora_manager
        num_blocks, max_embeds_per_item = parts.num_blocks, parts.max_embeds_per_item
        grammar_pool = GrammarCompilePool.for_tokenizer(
            loaded.tokenizer, runner.sampling.vocab_size, cfg.structured_outputs_config.backend,
            sorted(loaded.eos_token_ids))
        reasoning_parser = cfg.structured_outputs_config.reasoning_parser
        gate = (ReasoningGate(get_reasoning_parser(reasoning_parser), loaded.tokenizer)
                if reasoning_parser is not None else None)
        scheduler = Scheduler(cfg.scheduler_config, cfg.cache_config, loaded.max_model_len, num_blocks,
                              cfg.lora_config, lora_manager.host_ready if lora_manager is not None else None,
                              lora_pool=lora_manager.rank_pool() if lora_manager is not None else None,
                              lora_rank=lora_manager.adapter_rank if lora_manager is not None else None,
                              max_embeds_per_mm_item=max_embeds_per_item,
                              structured_output=StructuredOutputManager(grammar_pool,
                                                                        cfg.scheduler_config.max_num_seqs),
                              new_reasoning_tracker=(lambda request: gate.tracker(request.prompt_token_ids))
                              if gate is not None else None,
                              kv_group_windows=runner.kv_cache.groups.group_windows,
                              whole_media_chunks=runner.model.capabilities.bidirectional_media)
        processor = Processor(loaded.tokenizer, cfg.model_config, loaded.max_model_len,
                              loaded.hf_config.get_text_config().vocab_size, loaded.eos_token_ids,
                              lora_enabled=cfg.lora_config is not None,
                              max_n=cfg.scheduler_config.max_num_seqs, mm_processor=loaded.mm_processor,
                              mm_config=cfg.mm_config,
                              transcriber=loaded.transcriber.with_chunking(cfg.mm_config.audio_chunking)
                              if loaded.transcriber is not None else None,
                              grammar_pool=grammar_pool,
                              adapter_uploads=lora_manager.client_uploads() if lora_manager is not None else None,
                              serving=engine_args.usage_context == "server")
        facts = EngineFacts(model_name=loaded.model_name, max_model_len=loaded.max_model_len,
                            engine_config=cfg, tokenizer=loaded.tokenizer, processor=processor,
                            default_sampling_params=loaded.default_sampling,
                            lora_enabled=cfg.lora_config is not None)
        if lora_manager is not None:
            lora_manager.demand = scheduler.lora_demand   # host-store eviction keeps adapters waited for
        core = cls(cfg, runner, scheduler, facts, lora_manager, executor)
        freeze_gc_heap()
        return core

    # ------------------------------------------------------------------ requests
    def add_request(self, command: AddRequest) -> None:
        """Queue a user request's sequences (all or none). Raises ValueError / LoRA errors, or
        EngineDeadError after a fatal step fault.

        An adapter the request names is registered from the weights it carries (read by the client:
        ``LoRARequest.adapter``); the sequences keep the request without them. A request refused after
        that leaves nothing behind: an adapter registered for it alone is removed again."""
        if self._dead_error is not None:
            raise self._dead_error
        children = command.children
        for child in children:
            if child.request_id in self.scheduler.requests:
                raise ValueError(f"request_id: {command.request_id!r} is already in use.")
        lora_request = children[0].lora_request
        registered_now = False
        if lora_request is not None and self.lora_manager is not None:
            # A request that carries no weights for an adapter the engine lacks (the client's record of
            # sent adapters was out of date): the loader reads it; the request waits meanwhile.
            registered_now = self.lora_manager.register(lora_request, read_later=True)
            lora_request = lora_request.without_adapter()
            for child in children:
                child.lora_request = lora_request   # the scheduler's requests do not keep the weights alive
        added = []
        try:
            for child in children:
                if child.request_id in self.scheduler.requests:
                    raise ValueError(f"request_id: {command.request_id!r} is already in use.")
                self.scheduler.add_request(Request(child))
                added.append(child.request_id)
        except Exception:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            if registered_now:
                self.lora_manager.remove(lora_request.lora_name)
            raise
        if lora_request is not None and self.executor is not None:
            self.executor.add_adapter(lora_request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish sequences (child ids) now; unknown or finished ones are ignored."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    # ------------------------------------------------------------------ step
    def step(self) -> list[EngineCoreOutput]:
        """Schedule and run one step; return the sequences' news of the step that completed.

        Async scheduling: schedule step N+1 (requests whose step-N token is still on the device
        count it as a placeholder), launch it, then wait for step N's sampled ids (the one host
        sync) and process them while the device runs N+1. A request that step N finished drops
        the token N+1 computed for it (``update_from_output`` no longer knows it).

        Adapters: the reads the loader finished enter host memory first (``_take_adapter_reads``; a read
        that failed ends the requests waiting for it with its LoRA error, 4xx, and the step runs the
        others). ``schedule()`` loads into slots only adapters in host memory (``Scheduler``'s
        ``lora_ready``), and nothing enters or leaves the host store between it and the runner's slot
        loads, so the step runs as scheduled, on every rank; its ``SchedulerOutput`` is frozen.

        A step that raises is recovered (``_recover_from_fault``): the sequences it ran end in
        ``take_failed()`` and this returns []. Raises ``EngineDeadError`` when the fault is fatal.
        """
        if self._dead_error is not None:
            raise self._dead_error
        launched = self._in_flight
        so: Optional[SchedulerOutput] = None
        try:
            self._take_adapter_reads()
            so = self.scheduler.schedule()
            self._wait_for_adapter_reads(so)
            self._wait_for_grammars(so)
            outputs = self._run(so)
        except Exception as e:  # noqa: BLE001 - recovered, or turned into EngineDeadError
            self._recover_from_fault(e, [s for s in (launched[0] if launched else None, so) if s is not None])
            return []
        self._num_consecutive_faults = 0
        return outputs

    def _run(self, so: SchedulerOutput) -> list[EngineCoreOutput]:
        settled: list[EngineCoreOutput] = []
        grammar = self._grammar_source(so, settled)
        if self.executor is not None:
            self.executor.send_step(so)   # the workers run the same step alongside the runner below
        if not self.async_scheduling:
            result = self.runner.execute(so, grammar)
            self._raise_injected_fault()
            return self._update(so, result)
        pending = self.runner.execute_async(so, grammar, sample_with_next=self._sample_with_next)
        self._raise_injected_fault()
        prev, self._in_flight = self._in_flight, None
        outputs = settled + (self._update(*prev) if prev is not None else [])
        if so.total_num_scheduled_tokens > 0:
            self._in_flight = (so, pending)
        else:
            outputs += self._update(so, pending)
        return outputs

    def _grammar_source(self, so: SchedulerOutput,
                        settled: list[EngineCoreOutput]) -> Optional[GrammarSource]:
        """What the runner asks for the bitmask of ``so``'s constrained rows (None when ``so`` samples no
        constrained request). Sampled with the next step (``_sample_with_next``), every earlier step is
        settled by then; otherwise it is asked for once the forward is launched and settles the step in
        flight first (its outputs go to ``settled``), so every matcher has taken its request's earlier
        tokens. Then it fills the bitmask on the host; the tensor-parallel workers get the same bitmask."""
        if not so.structured_output_req_ids:
            return None

        def fill(sample_req_ids: list[str]) -> Optional[GrammarBitmask]:
            if not self._sample_with_next:
                prev, self._in_flight = self._in_flight, None
                if prev is not None:
                    settled.extend(self._update(*prev))
            bitmask = self.scheduler.grammar_bitmask(sample_req_ids)
            if self.executor is not None:
                self.executor.send_grammar_bitmask(bitmask)
            return bitmask
        return fill

    def _wait_for_grammars(self, so: SchedulerOutput) -> None:
        """A step that scheduled nothing while grammars compile waits for one briefly instead of spinning
        (the requests that need them wait; the others were scheduled)."""
        manager = self.scheduler.structured_output
        if so.total_num_scheduled_tokens == 0 and self._in_flight is None and manager is not None:
            manager.wait_for_compilation(GRAMMAR_COMPILE_POLL_S)

    def take_failed(self) -> dict[str, BaseException]:
        """Sequences ended with an error since the last call: sequence id -> ``EngineStepError``
        (500), a LoRA error (4xx) or a ``StructuredOutputError`` (400: a grammar that did not compile or
        rejected a token). The client reports the error instead of an output."""
        failed, self._failed = self._failed, {}
        if self.scheduler is not None:
            failed.update(self.scheduler.take_failed())
        return failed

    # ------------------------------------------------------------------ faults
    def _take_adapter_reads(self) -> None:
        """Put the adapters the loader thread read (``LoRAManager.take_reads``) in host memory, so their
        waiting requests can be scheduled; a read that failed ends the waiting requests that needed
        it with its LoRA error (4xx)."""
        if self.lora_manager is None:
            return
        errors = self.lora_manager.take_reads()
        if not errors:
            return
        slots = self.scheduler.lora_slots
        failed = {}
        for req_id, request in self.scheduler.requests.items():
            lora_name = request.lora_request.lora_name if request.lora_request else None
            if (lora_name in errors and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                    and (slots is None or slots.slot_of(lora_name) is None)):
                failed[req_id] = errors[lora_name]
        for lora_name, e in errors.items():
            logger.warning("LoRA adapter %r could not be read; its waiting requests fail: %s", lora_name, e)
        self.scheduler.fail_requests(failed)
        self._failed.update(failed)

    def _wait_for_adapter_reads(self, so: SchedulerOutput) -> None:
        """A step that scheduled nothing while the loader reads adapters waits for a read briefly instead
        of spinning (the requests that need the adapters wait for it: ``Scheduler``'s ``lora_ready``)."""
        if (so.total_num_scheduled_tokens == 0 and self._in_flight is None and self.lora_manager is not None
                and self.lora_manager.adapter_reads_pending()):
            self.lora_manager.loader.wait(ADAPTER_READ_POLL_S)

    def _recover_from_fault(self, error: Exception, steps: list[SchedulerOutput]) -> None:
        """Fail the sequences of ``steps`` (the step that raised, and the launched one it was
        completing) with ``EngineStepError`` and free what they held; raise ``EngineDeadError`` if the
        fault is fatal (a CUDA error, or ``MAX_CONSECUTIVE_STEP_FAULTS`` in a row)."""
        self._in_flight = None
        self.runner.drop_unsampled()
        self._num_consecutive_faults += 1
        req_ids = list(dict.fromkeys(rid for so in steps for rid in so.num_scheduled_tokens))
        stale_loras = {load.lora_request.lora_name for so in steps for load in so.lora_loads}
        fatal = _fatal_reason(error, self._num_consecutive_faults, self.executor)
        logger.error("Engine step failed (%d in a row) with %d request(s): %s", self._num_consecutive_faults,
                     len(req_ids), "fatal: " + fatal if fatal else "recovering", exc_info=error)
        cause = f"{type(error).__name__}: {error}"
        if fatal:
            step_error = EngineStepError(
                f"An internal engine error occurred while running this request ({cause}); the engine is "
                f"stopping ({fatal}) and must be restarted.")
        else:
            step_error = EngineStepError(
                f"An internal engine error occurred while running this request ({cause}); the engine "
                "freed it and keeps serving: retry the request, and report the error if it repeats.")
        self._failed.update({rid: step_error for rid in req_ids})
        if fatal:
            self._dead_error = EngineDeadError(f"The engine stopped after a step failed ({fatal}): {cause}")
            raise self._dead_error from error
        self.scheduler.fail_requests(req_ids, stale_loras)

    def inject_step_faults(self, error: BaseException, num_steps: int) -> None:
        """Test hook: each of the next ``num_steps`` steps raises ``error`` once the runner has
        launched it (as a failing model runner would)."""
        self._injected_fault = (error, num_steps) if num_steps > 0 else None

    def _raise_injected_fault(self) -> None:
        if self._injected_fault is None:
            return
        error, num_left = self._injected_fault
        self._injected_fault = (error, num_left - 1) if num_left > 1 else None
        raise error

    def _update(self, so: SchedulerOutput,
                result: ModelRunnerOutput | PendingOutput) -> list[EngineCoreOutput]:
        runner_out = result.get() if isinstance(result, PendingOutput) else result
        outputs = self.scheduler.update_from_output(so, runner_out)
        if self.lora_manager is not None and self.lora_manager.pending_removals():
            self._retry_lora_removals()
        return outputs

    # ------------------------------------------------------------------ adapters, stats
    def add_lora(self, lora_request, read_later: bool = False, checked: bool = False) -> bool:
        """Load an adapter now so requests can name it: from the weights ``lora_request.adapter``
        carries (the clients read them on their own thread), else read here; with ``read_later`` (a
        client in another process, which sends no weights: ``AdapterUploads.ship_weights``) checked here
        from its config and its weights file's header (unless the client ``checked`` it), and read by the
        loader thread, off the step loop, its requests waiting for the read.

        Loading a name that is being unloaded keeps it. Raises ``LoRAAdapterNotFoundError``
        (missing path or files) or another ``ValueError`` (an adapter that cannot be served).
        """
        if self.lora_manager is None:
            raise ValueError("LoRA adapters are not enabled; start the engine with enable_lora=True.")
        if read_later and lora_request.adapter is None and not checked:
            self.lora_manager.reader.check(lora_request)      # the errors now; the weights on the loader thread
        self.lora_manager.register(lora_request, keep_if_removing=True, read_later=read_later)
        if self.executor is not None:
            self.executor.add_adapter(lora_request.without_adapter())
        return True

    def remove_lora(self, lora_name: str) -> bool:
        """Unload an adapter: new requests naming it are refused at once; requests still using it
        finish first, then its slot and host copy are freed (retried after every step).

        Returns:
            False if no adapter of that name is loaded.
        """
        if self.lora_manager is None or not self.lora_manager.begin_remove(lora_name):
            return False
        self._retry_lora_removals()
        return True

    def list_loras(self) -> list:
        """The ``LoRARequest`` of every loaded adapter (not those being unloaded)."""
        return [] if self.lora_manager is None else self.lora_manager.list_loras()

    def _retry_lora_removals(self) -> None:
        for name in self.lora_manager.pending_removals():
            if self.scheduler.remove_lora(name):
                self.lora_manager.remove(name)
                if self.executor is not None:
                    self.executor.remove_adapter(name)

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.get_stats()
        if self.lora_manager is not None:
            stats.num_loras_registered = (len(self.lora_manager.list_loras())
                                          + len(self.lora_manager.pending_removals()))
            stats.num_lora_host_loads = self.lora_manager.store.num_loads
            stats.num_lora_host_evictions = self.lora_manager.store.num_evictions
            reads = self.lora_manager.loader.read_totals()
            stats.num_lora_disk_reads, stats.lora_disk_read_bytes = reads.num_reads, reads.nbytes
            stats.lora_disk_read_s, stats.lora_disk_read_queued_s = reads.read_s, reads.queued_s
            stats.lora_rank_row_bytes = self.lora_manager.row_bytes
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def call(self, call: EngineCall) -> Any:
        """Run one client call (``CallEngine``), told apart by its type. Raises TypeError for anything
        that is not an ``EngineCall``."""
        match call:
            case AddLoRA(lora_request=lora_request, checked=checked):
                return self.add_lora(lora_request, read_later=lora_request.adapter is None, checked=checked)
            case RemoveLoRA(lora_name=lora_name):
                return self.remove_lora(lora_name)
            case ListLoRAs():
                return self.list_loras()
            case ResetPrefixCache():
                return self.reset_prefix_cache()
            case GetStats():
                return self.get_stats()
            case AlignmentScores():
                if self.executor is not None or self.lora_manager is not None:
                    raise ValueError("word timestamps need --tensor-parallel-size 1 and no --enable-lora.")
                return alignment_scores(self.runner.model, self.runner.device, call)
        refuse_non_call(call)
        raise AssertionError(f"EngineCore.call has no case for {type(call).__name__}.")

    # ------------------------------------------------------------------ the loop
    def handle(self, command: EngineCommand, rejected: dict[str, BaseException]) -> Optional[CoreMessage]:
        """Apply one command. Returns the reply to send (a ``CallResult``), if any; a refused
        ``AddRequest`` goes into ``rejected``; ``InjectFault`` raises (or arms step faults)."""
        if isinstance(command, AddRequest):
            try:
                self.add_request(command)
            except Exception as e:  # noqa: BLE001 - the client decides (ValueError -> 400)
                rejected[command.request_id] = e
        elif isinstance(command, AbortRequests):
            self.abort_requests(command.request_ids)
        elif isinstance(command, CallEngine):
            try:
                return CallResult(command.call_id, self.call(command.call))
            except Exception as e:  # noqa: BLE001 - returned to the caller
                return CallResult(command.call_id, error=e)
        elif isinstance(command, InjectFault):
            if command.num_steps <= 0:
                raise command.error
            self.inject_step_faults(command.error, command.num_steps)
        else:
            raise AssertionError(f"unknown engine command {command!r}")
        return None

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; the loop calls it when it ends). After a
        fatal step fault they are terminated: one may wait in a collective of the failed step."""
        if self.executor is not None:
            self.executor.close(graceful=self._dead_error is None)

    def close(self) -> None:
        """Release everything the core holds: ``shutdown``, then drop the model, its KV cache, the
        adapters and the scheduler, collect what referred to them (the start-up heap is frozen out of
        the collector's reach, ``freeze_gc_heap``: unfrozen for this pass) and hand the device's cached
        memory back (CUDA). Idempotent; every later ``step`` / ``add_request`` raises EngineDeadError."""
        self.shutdown()
        if self.runner is None:
            return
        self._dead_error = self._dead_error or EngineDeadError("The engine was closed.")
        self._in_flight = None
        self._failed = {}
        self._injected_fault = None
        self.runner = self.scheduler = self.lora_manager = self.executor = None
        release_engine_memory()

    def _watch_workers(self, channel: CoreChannel) -> None:
        """Tensor parallelism: a worker that dies while the loop waits for commands makes the engine
        dead at once (``EngineDead`` to the client: /health fails, ``chorus serve`` exits)."""
        def on_death(reason: str) -> None:
            self._dead_error = EngineDeadError(reason)
            self._send_dead(channel, reason)
        self.executor.on_death = on_death

    def _send_dead(self, channel: CoreChannel, reason: str) -> None:
        if self._dead_sent.acquire(blocking=False):
            channel.put(EngineDead(reason))

    def run(self, channel: CoreChannel) -> None:
        """The engine loop: until ``Shutdown`` (or an error, reported as ``EngineDead``)."""
        if self.executor is not None:
            self._watch_workers(channel)
        try:
            while True:
                rejected: dict[str, BaseException] = {}
                drained = self._drain(channel, block=not self.has_unfinished_requests(), rejected=rejected)
                if drained is None:
                    return
                if self.has_unfinished_requests():
                    outputs = self.step()
                    channel.put(EngineCoreOutputs(outputs, self.get_stats(), rejected, self.take_failed()))
                elif drained:   # e.g. blocks freed by an abort, or a refused request
                    channel.put(EngineCoreOutputs([], self.get_stats(), rejected, self.take_failed()))
        except BaseException as e:  # noqa: BLE001 - any escape kills the engine, by design
            if not isinstance(e, EngineDeadError):
                logger.exception("Engine loop died.")
            failed = self.take_failed()
            if failed:   # a fatal step fault: its requests get their 500 before everyone's 503
                channel.put(EngineCoreOutputs([], None, {}, failed))
            self._send_dead(channel, f"Engine loop died: {e!r}")
        finally:
            self.shutdown()

    def _drain(self, channel: CoreChannel, block: bool, rejected: dict[str, BaseException]) -> Optional[int]:
        """Apply the queued commands (waiting for one while ``block``). Returns how many were
        applied, or None on ``Shutdown``."""
        count = 0
        while True:
            command = channel.get(block)
            if command is None:
                return count
            if isinstance(command, Shutdown):
                return None
            block = False
            count += 1
            reply = self.handle(command, rejected)
            if reply is not None:
                channel.put(reply)


def release_engine_memory() -> None:
    """Collect a released engine's objects (reference cycles included: the heap frozen at start-up is
    unfrozen for the pass, and what is still alive frozen again) and return cached CUDA memory, the
    cuBLAS workspaces the engine's matmuls allocated included (the next engine allocates its own)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()


def _is_device_error(error: BaseException) -> bool:
    """Whether ``error`` leaves the CUDA context unusable: by its type (``_ACCELERATOR_ERRORS``), else
    by its message (``_CUDA_ERROR_MARKERS``). Running out of memory (``torch.cuda.OutOfMemoryError``)
    does not: the step's requests fail and the engine keeps serving."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return False
    if isinstance(error, _ACCELERATOR_ERRORS):
        return True
    return any(marker in str(error) for marker in _CUDA_ERROR_MARKERS)


def _fatal_reason(error: BaseException, num_consecutive_faults: int, executor=None) -> Optional[str]:
    """Why a step fault stops the engine (None: recover from it)."""
    if executor is not None:
        return executor.dead_reason or ("a step failed with tensor parallelism, after which the ranks "
                                        "cannot be assumed to be in step")
    if _is_device_error(error):
        return "a CUDA error leaves the device unusable"
    if num_consecutive_faults >= MAX_CONSECUTIVE_STEP_FAULTS:
        return f"{num_consecutive_faults} steps failed in a row"
    return None
