"""``EngineCore``: scheduler -> model runner -> scheduler update, one step at a time, and the one
engine loop that drains commands, steps and emits one ``EngineCoreOutputs`` per step.

The core deals in sequences and token ids only: the client (``AsyncLLM`` or the offline
``LLMEngine``) tokenizes, fans ``n > 1`` out, detokenizes, finds stop strings and builds
``RequestOutput``s. ``run(channel)`` is the loop; it runs in a thread of the API process or in a
process of its own (``engine/core_transport.py``), identical in both: only the ``CoreChannel``
differs. The offline ``LLMEngine`` calls ``step()`` directly, without a loop or a thread.

    run(channel):  repeat
        drain commands (block while idle): AddRequest / AbortRequests / CallMethod / InjectFault / Shutdown
        if work: step(); channel.put(EngineCoreOutputs(outputs of the step, stats))
        an exception escaping here: channel.put(EngineDead(...)), and the loop ends

With async scheduling (the default) each ``step()`` schedules and launches step N+1 before it
reads step N's sampled ids, so scheduling and the update of one step overlap the device's work
on the next.
"""

from __future__ import annotations

import atexit
import gc
import logging
from typing import Iterable, Optional, Protocol

import torch

import engine.envs as envs
from engine.arg_utils import EngineArgs
from engine.config import EngineConfig
from engine.core_messages import (CALLABLE_METHODS, AbortRequests, AddRequest, CallMethod, CallResult,
                                  CoreMessage, EngineCommand, EngineCoreOutputs, EngineDead, EngineFacts,
                                  InjectFault, Shutdown)
from engine.model_runner import ModelRunner, PendingOutput, max_blocks_needed, resolve_device
from engine.models.builder import build_model
from engine.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SchedulerStats
from engine.processor import Processor
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler

logger = logging.getLogger("chorus.engine_core")


def freeze_gc_heap() -> None:
    """Move everything allocated so far (model, tokenizer, imports: long-lived) out of the garbage
    collector's reach, so its full passes stop rescanning it (as vLLM does): on CPU they were ~60%
    of the client's per-token output processing. Unfrozen at exit, so finalizers still run."""
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
    """

    def __init__(self, engine_config: EngineConfig, runner: ModelRunner, scheduler: Scheduler,
                 facts: EngineFacts, lora_manager=None) -> None:
        self.engine_config = engine_config
        self.runner = runner
        self.scheduler = scheduler
        self.facts = facts
        self.lora_manager = lora_manager
        self.async_scheduling = engine_config.scheduler_config.async_scheduling
        self._in_flight: Optional[tuple[SchedulerOutput, PendingOutput]] = None
        """Async scheduling: the launched step whose output has not been processed yet."""

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "EngineCore":
        """Load the model, size the KV cache, build the scheduler (minutes for large models)."""
        if envs.num_threads():
            torch.set_num_threads(envs.num_threads())
        probe = engine_args.create_engine_config()
        device = resolve_device(probe.device)
        loaded = build_model(probe.model_config, device)
        cfg = engine_args.create_engine_config(loaded.max_model_len)
        runner = ModelRunner(cfg, loaded.model, loaded.hf_config, device, loaded.dtype)
        lora_manager = None
        if cfg.lora_config is not None:
            from lora.manager import LoRAManager
            lora_manager = LoRAManager(cfg.lora_config, loaded.model, device, loaded.dtype,
                                       policy=runner.policy)
            runner.lora_manager = lora_manager
        max_embeds_per_item = loaded.mm_processor.max_embeds_per_item() if loaded.mm_processor else 0
        if max_embeds_per_item:   # a media model: the encoder cache's outputs take memory beside the KV cache
            runner.encoder_compute_budget, runner.encoder_cache_size = cfg.scheduler_config.encoder_budgets(
                max_embeds_per_item)
        # Encoder-decoder models: each request also holds cross-attention K/V of its encoder output.
        cross_tokens = max_embeds_per_item if runner.is_encoder_decoder else 0
        num_blocks = runner.determine_num_blocks(max_blocks_needed(
            cfg.scheduler_config.max_num_seqs, loaded.max_model_len, cfg.cache_config.block_size, cross_tokens))
        runner.allocate_kv_cache(num_blocks)
        scheduler = Scheduler(cfg.scheduler_config, cfg.cache_config, loaded.max_model_len, num_blocks,
                              cfg.lora_config, max_embeds_per_mm_item=max_embeds_per_item)
        processor = Processor(loaded.tokenizer, cfg.model_config, loaded.max_model_len,
                              loaded.hf_config.get_text_config().vocab_size, loaded.eos_token_ids,
                              lora_enabled=cfg.lora_config is not None,
                              max_n=cfg.scheduler_config.max_num_seqs, mm_processor=loaded.mm_processor,
                              mm_config=cfg.mm_config, transcriber=loaded.transcriber)
        facts = EngineFacts(model_name=loaded.model_name, max_model_len=loaded.max_model_len,
                            engine_config=cfg, tokenizer=loaded.tokenizer, processor=processor,
                            default_sampling_params=loaded.default_sampling,
                            lora_enabled=cfg.lora_config is not None)
        core = cls(cfg, runner, scheduler, facts, lora_manager)
        freeze_gc_heap()
        return core

    # ------------------------------------------------------------------ requests
    def add_request(self, command: AddRequest) -> None:
        """Queue a user request's sequences (all or none). Raises ValueError / LoRA errors."""
        children = command.children
        lora_request = children[0].lora_request
        if lora_request is not None and self.lora_manager is not None:
            self.lora_manager.register(lora_request)
            if self.lora_manager.adapts_encoder(lora_request.lora_name):
                # The encoder output depends on the adapter: its own encoder-cache entries.
                for child in children:
                    child.mm_features = [f.with_encoder_adapter(lora_request.lora_name) for f in child.mm_features]
        added = []
        try:
            for child in children:
                if child.request_id in self.scheduler.requests:
                    raise ValueError(f"request_id: {command.request_id!r} is already in use.")
                self.scheduler.add_request(Request(child))
                added.append(child.request_id)
        except Exception:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise

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
        """
        so = self.scheduler.schedule()
        if not self.async_scheduling:
            return self._update(so, self.runner.execute(so))
        pending = self.runner.execute_async(so)
        prev, self._in_flight = self._in_flight, None
        outputs = self._update(*prev) if prev is not None else []
        if so.total_num_scheduled_tokens > 0:
            self._in_flight = (so, pending)
        else:
            outputs += self._update(so, pending)
        return outputs

    def _update(self, so: SchedulerOutput,
                result: ModelRunnerOutput | PendingOutput) -> list[EngineCoreOutput]:
        runner_out = result.get() if isinstance(result, PendingOutput) else result
        outputs = self.scheduler.update_from_output(so, runner_out)
        if self.lora_manager is not None and self.lora_manager.pending_removals():
            self._retry_lora_removals()
        return outputs

    # ------------------------------------------------------------------ adapters, stats
    def add_lora(self, lora_request) -> bool:
        """Load an adapter now (validate, read into host memory) so requests can name it.

        Loading a name that is being unloaded keeps it. Raises ``LoRAAdapterNotFoundError``
        (missing path or files) or another ``ValueError`` (an adapter that cannot be served).
        """
        if self.lora_manager is None:
            raise ValueError("LoRA adapters are not enabled; start the engine with enable_lora=True.")
        self.lora_manager.register(lora_request, keep_if_removing=True)
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

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    # ------------------------------------------------------------------ the loop
    def handle(self, command: EngineCommand, rejected: dict[str, BaseException]) -> Optional[CoreMessage]:
        """Apply one command. Returns the reply to send (a ``CallResult``), if any; a refused
        ``AddRequest`` goes into ``rejected``; ``InjectFault`` raises."""
        if isinstance(command, AddRequest):
            try:
                self.add_request(command)
            except Exception as e:  # noqa: BLE001 - the client decides (ValueError -> 400)
                rejected[command.request_id] = e
        elif isinstance(command, AbortRequests):
            self.abort_requests(command.request_ids)
        elif isinstance(command, CallMethod):
            try:
                if command.method not in CALLABLE_METHODS:
                    raise AttributeError(f"engine method {command.method!r} cannot be called by name; "
                                         f"use one of {CALLABLE_METHODS}.")
                return CallResult(command.call_id, getattr(self, command.method)(*command.args))
            except Exception as e:  # noqa: BLE001 - returned to the caller
                return CallResult(command.call_id, error=e)
        elif isinstance(command, InjectFault):
            raise command.error
        else:
            raise AssertionError(f"unknown engine command {command!r}")
        return None

    def run(self, channel: CoreChannel) -> None:
        """The engine loop: until ``Shutdown`` (or an error, reported as ``EngineDead``)."""
        try:
            while True:
                rejected: dict[str, BaseException] = {}
                drained = self._drain(channel, block=not self.has_unfinished_requests(), rejected=rejected)
                if drained is None:
                    return
                if self.has_unfinished_requests():
                    outputs = self.step()
                    channel.put(EngineCoreOutputs(outputs, self.get_stats(), rejected))
                elif drained:   # e.g. blocks freed by an abort, or a refused request
                    channel.put(EngineCoreOutputs([], self.get_stats(), rejected))
        except BaseException as e:  # noqa: BLE001 - any escape kills the engine, by design
            logger.exception("Engine loop died.")
            channel.put(EngineDead(f"Engine loop died: {e!r}"))

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
