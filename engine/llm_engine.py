"""``LLMEngine``: the synchronous client of an in-process ``EngineCore`` (what ``LLM`` drives).

processor (validate, tokenize, fan out n) -> ``EngineCore.step()`` (token ids) -> output processor
(detokenize, stop strings, ``RequestOutput``s), all on the caller's thread: no loop, no thread and
no message copies, so offline generation pays nothing for the serving machinery. A stop string
found by the output processor aborts its sequence in the core, as in ``AsyncLLM``.
"""

from __future__ import annotations

import logging
import weakref
from typing import Iterable, Optional

from engine.arg_utils import EngineArgs
from engine.core_messages import AddRequest
from engine.engine_core import EngineCore
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput, SchedulerStats
from engine.processor import PromptType
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams

logger = logging.getLogger("chorus.engine")


class LLMEngine:
    """Single-threaded: ``add_request`` then ``step()`` until ``has_unfinished_requests()`` is False.

    The core's parts stay reachable for tests and tools: ``runner``, ``scheduler``,
    ``lora_manager``, ``engine_config``.
    """

    def __init__(self, engine_args: EngineArgs) -> None:
        self.engine_args = engine_args
        self.core = EngineCore.from_engine_args(engine_args)
        facts = self.core.facts
        self.engine_config = facts.engine_config
        self.max_model_len = facts.max_model_len
        self.default_sampling_params: dict = facts.default_sampling_params  # generation_config defaults
        self.tokenizer = facts.tokenizer
        self.model_name = facts.model_name
        self.processor = facts.processor
        self.output_processor = OutputProcessor(self.tokenizer)
        self._release = weakref.finalize(self, EngineCore.close, self.core)
        """Closes the core once: on ``close()``, or when this engine is garbage (not at interpreter exit:
        the tensor-parallel workers are joined by their own exit hook)."""
        self._release.atexit = False

    def close(self) -> None:
        """Release the engine: abort its unfinished requests, stop and join the tensor-parallel workers
        and destroy their process group, drop the model, KV cache and adapters and return cached GPU
        memory (``EngineCore.close``). Idempotent; afterwards requests raise EngineDeadError."""
        if self._release.alive and self.output_processor.parents:
            self.abort_request(list(self.output_processor.parents))
        self._release()

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran (or the engine was collected)."""
        return not self._release.alive

    @classmethod
    def from_engine_args(cls, **kwargs) -> "LLMEngine":
        return cls(EngineArgs.from_kwargs(**kwargs))

    @property
    def runner(self):
        return self.core.runner

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def lora_manager(self):
        return self.core.lora_manager

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, lora_request=None,
                    priority: int = 0, arrival_time: Optional[float] = None,
                    cache_salt: Optional[str] = None) -> None:
        """Validate and queue one request. Raises ValueError (naming the field) on bad input."""
        text, children = self.processor.process(request_id, prompt, params, lora_request, priority,
                                                arrival_time, cache_salt)
        try:
            self.add_processed(request_id, text, children)
        except Exception:
            uploads = self.processor.adapter_uploads
            if lora_request is not None and uploads is not None and lora_request.lora_name not in {
                    r.lora_name for r in self.core.list_loras()}:
                uploads.forget(lora_request.lora_name)   # refused: the engine kept no copy
            raise

    def add_processed(self, request_id: str, text: Optional[str], children: list[EngineRequest]) -> None:
        """Queue a request the processor already validated (``text``: its prompt text, if any)."""
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id: {request_id!r} is already in use.")
        self.core.add_request(AddRequest(request_id, children))
        self.output_processor.add_request(request_id, children, text)

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Abort user requests; returns their final outputs (finish_reason 'abort')."""
        outputs, child_ids = self.output_processor.abort_requests(list(request_ids))
        self.core.abort_requests(child_ids)
        return outputs

    def has_unfinished_requests(self) -> bool:
        if self.closed:
            return False
        return self.core.has_unfinished_requests() or self.output_processor.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one core step; return the request outputs that became ready.

        A request the step failed is returned like any other, as its final output with ``error`` set
        (``RequestOutput.error``: an ``EngineStepError`` when the step raised and the core recovered, a
        LoRA error when an adapter could not be read again from disk) and finish_reason 'error'; the
        other requests' outputs of the step, final ones included, come back beside it, and the engine
        stays usable.

        Raises:
            EngineDeadError: a fatal step fault (README, "Failure behaviour").
        """
        outputs, stopped = self.output_processor.process(self.core.step())
        if stopped:
            self.core.abort_requests(stopped)
        failed = self.core.take_failed()
        if failed:
            outputs += self._fail_requests(failed)
        return outputs

    def _fail_requests(self, failed: dict[str, BaseException]) -> list[RequestOutput]:
        """End the requests of the sequences the core failed (sequence id -> error): their final
        outputs, carrying the first error of each; their other sequences (``n`` > 1) are aborted."""
        errors: dict[str, BaseException] = {}
        for child_id, error in failed.items():
            child = self.output_processor.children.get(child_id)
            if child is None:
                continue   # its request already ended
            if child.finish_reason is None:
                child.finish_reason = "error"
            errors.setdefault(child.parent.request_id, error)
        outputs = self.abort_request(list(errors))
        for out in outputs:
            out.error = errors[out.request_id]
        return outputs

    # ------------------------------------------------------------------ adapters, stats
    def add_lora(self, lora_request) -> bool:
        """Load an adapter now: read from disk on this thread, then handed to the core. Raises the LoRA
        errors of ``LoRAManager.register``."""
        uploads = self.processor.adapter_uploads
        if uploads is None:
            return self.core.add_lora(lora_request)   # LoRA disabled: the core says so
        loaded = uploads.read(lora_request)
        added = self.core.add_lora(loaded)
        uploads.mark_sent(loaded)
        return added

    def remove_lora(self, lora_name: str) -> bool:
        if self.processor.adapter_uploads is not None:
            self.processor.adapter_uploads.forget(lora_name)
        return self.core.remove_lora(lora_name)

    def list_loras(self) -> list:
        return self.core.list_loras()

    def get_stats(self) -> SchedulerStats:
        return self.core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()
