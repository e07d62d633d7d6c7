"""``LLMEngine``: the synchronous client of an in-process ``EngineCore`` (what ``LLM`` drives).

processor (validate, tokenize, fan out n) -> ``EngineCore.step()`` (token ids) -> output processor
(detokenize, stop strings, ``RequestOutput``s), all on the caller's thread: no loop, no thread and
no message copies, so offline generation pays nothing for the serving machinery. A stop string
found by the output processor aborts its sequence in the core, as in ``AsyncLLM``.
"""

from __future__ import annotations

import logging
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
        self.add_processed(request_id, text, children)

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
        return self.core.has_unfinished_requests() or self.output_processor.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one core step; return the request outputs that became ready.

        Raises:
            EngineStepError: the step raised and the core recovered (the requests it ran are gone,
                the engine stays usable); a LoRA error: an adapter could not be read again from disk
                (its requests are gone). The other requests stay queued.
            EngineDeadError: a fatal step fault (README, "Failure behaviour").
        """
        outputs, stopped = self.output_processor.process(self.core.step())
        if stopped:
            self.core.abort_requests(stopped)
        failed = self.core.take_failed()
        if failed:
            parents = {self.output_processor.children[cid].parent.request_id
                       for cid in failed if cid in self.output_processor.children}
            self.abort_request(parents)   # their other sequences too
            raise next(iter(failed.values()))
        return outputs

    # ------------------------------------------------------------------ adapters, stats, chat
    def add_lora(self, lora_request) -> bool:
        return self.core.add_lora(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        return self.core.remove_lora(lora_name)

    def list_loras(self) -> list:
        return self.core.list_loras()

    def get_stats(self) -> SchedulerStats:
        return self.core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None, continue_final_message: bool = False,
                            **kwargs) -> str:
        return self.processor.apply_chat_template(messages, add_generation_prompt, chat_template,
                                                  continue_final_message, **kwargs)
