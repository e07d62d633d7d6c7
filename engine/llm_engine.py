"""``LLMEngine``: processor -> scheduler -> model runner -> output processor, one ``step()`` at a time.

Single-threaded; ``LLM`` drives it offline and ``AsyncLLM`` from a thread. With async scheduling
(the default) each ``step()`` schedules and launches step N+1 before it reads step N's sampled
ids, so scheduling, update and detokenization of one step overlap the device's work on the next.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch

from engine.arg_utils import EngineArgs
from engine.config import EngineConfig
from engine.model_runner import ModelRunner, PendingOutput, max_blocks_needed, resolve_device
from engine.models.builder import build_model
from engine.output_processor import OutputProcessor
from engine.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput, SchedulerStats
from engine.processor import Processor, PromptType
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

logger = logging.getLogger("chorus.engine")


class LLMEngine:
    def __init__(self, engine_args: EngineArgs) -> None:
        from engine import envs
        if envs.num_threads():
            torch.set_num_threads(envs.num_threads())
        self.engine_args = engine_args
        probe = engine_args.create_engine_config()
        self.device = resolve_device(probe.device)
        loaded = build_model(probe.model_config, self.device)
        self.engine_config: EngineConfig = engine_args.create_engine_config(loaded.max_model_len)
        self.max_model_len = loaded.max_model_len
        self.default_sampling_params: dict = loaded.default_sampling  # generation_config defaults
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.model_name
        self.hf_config = loaded.hf_config
        self.dtype = loaded.dtype
        cfg = self.engine_config
        self.runner = ModelRunner(cfg, loaded.model, loaded.hf_config, self.device, loaded.dtype)
        self.lora_manager = None
        if cfg.lora_config is not None:
            from lora.manager import LoRAManager
            self.lora_manager = LoRAManager(cfg.lora_config, loaded.model, self.device, loaded.dtype)
            self.runner.lora_manager = self.lora_manager
        num_blocks = self.runner.determine_num_blocks(max_blocks_needed(
            cfg.scheduler_config.max_num_seqs, self.max_model_len, cfg.cache_config.block_size))
        self.runner.allocate_kv_cache(num_blocks)
        self.scheduler = Scheduler(cfg.scheduler_config, cfg.cache_config, self.max_model_len, num_blocks,
                                   cfg.lora_config)
        self.processor = Processor(self.tokenizer, cfg.model_config, self.max_model_len,
                                   loaded.hf_config.vocab_size, loaded.eos_token_ids,
                                   lora_enabled=cfg.lora_config is not None,
                                   max_n=cfg.scheduler_config.max_num_seqs)
        self.output_processor = OutputProcessor(self.tokenizer)
        # parent request id -> child request ids still known to the scheduler
        self._children: dict[str, list[str]] = {}
        self.async_scheduling = cfg.scheduler_config.async_scheduling
        # Async scheduling: the launched step whose output has not been processed yet.
        self._in_flight: Optional[tuple[SchedulerOutput, PendingOutput]] = None

    @classmethod
    def from_engine_args(cls, **kwargs) -> "LLMEngine":
        return cls(EngineArgs.from_kwargs(**kwargs))

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, lora_request=None,
                    priority: int = 0, arrival_time: Optional[float] = None,
                    cache_salt: Optional[str] = None) -> None:
        """Validate and queue one request. Raises ValueError (naming the field) on bad input."""
        text, children = self.processor.process(request_id, prompt, params, lora_request, priority,
                                                arrival_time, cache_salt)
        self.add_processed(request_id, text, children)

    def add_processed(self, request_id: str, text, children) -> None:
        if request_id in self._children:
            raise ValueError(f"request_id: {request_id!r} is already in use.")
        if children[0].lora_request is not None and self.lora_manager is not None:
            self.lora_manager.register(children[0].lora_request)
        added = []
        try:
            for child in children:
                self.scheduler.add_request(Request(child))
                added.append(child.request_id)
        except Exception:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        self.output_processor.add_request(request_id, children, text)
        self._children[request_id] = [c.request_id for c in children]

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Abort user requests (parent ids); returns their final outputs (finish_reason 'abort')."""
        child_ids = []
        for rid in request_ids:
            child_ids.extend(self._children.pop(rid, []))
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(child_ids)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self.output_processor.has_unfinished()
                or self._in_flight is not None)

    def get_num_unfinished_requests(self) -> int:
        return len(self._children)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; return the request outputs that became ready.

        Async scheduling: schedule step N+1 (requests whose step-N token is still on the device
        count it as a placeholder), launch it, then wait for step N's sampled ids (the one host
        sync) and process them while the device runs N+1. A request that step N finished drops
        the token N+1 computed for it (``update_from_output`` no longer knows it).
        """
        so = self.scheduler.schedule()
        if not self.async_scheduling:
            return self._process(so, self.runner.execute(so))
        pending = self.runner.execute_async(so)
        prev, self._in_flight = self._in_flight, None
        outputs = self._process(*prev) if prev is not None else []
        if so.total_num_scheduled_tokens > 0:
            self._in_flight = (so, pending)
        else:
            outputs += self._process(so, pending)
        return outputs

    def _process(self, so: SchedulerOutput, result: ModelRunnerOutput | PendingOutput) -> list[RequestOutput]:
        """Update the scheduler with one step's result and turn it into request outputs."""
        runner_out = result.get() if isinstance(result, PendingOutput) else result
        core_outputs = self.scheduler.update_from_output(so, runner_out)
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for out in outputs:
            if out.finished:
                self._children.pop(out.request_id, None)
        if self.lora_manager is not None and self.lora_manager.pending_removals():
            self._retry_lora_removals()
        return outputs

    # ------------------------------------------------------------------ adapters
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

    # ------------------------------------------------------------------ chat / tokens
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None, continue_final_message: bool = False,
                            **kwargs) -> str:
        return self.processor.apply_chat_template(messages, add_generation_prompt, chat_template,
                                                  continue_final_message, **kwargs)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()
