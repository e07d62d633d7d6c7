"""``PendingOutput``: one step's result, possibly still on the device."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from engine.outputs import LogprobsLists, ModelRunnerOutput


class PendingOutput:
    """One step's result; ``get()`` waits for its sampled ids (the step's one host sync) and builds its
    ``ModelRunnerOutput`` once. Reading it changes nothing else: the runner appends the sampled ids to its
    request states itself (``engine.runner.state.RequestStates.absorb_sampled``).

    Args:
        req_ids: the step's scheduled requests, in row order.
        sampled_req_ids: the requests that sampled a token, in the order of ``host_ids``.
        host_ids: [num_sampled] int64 pinned host tensor filled by a non-blocking copy, or a host list
            (None: nothing sampled).
        ready: recorded after that copy (None: already on the host).
        logprobs, prompt_logprobs: req_id -> the step's sample / prompt logprobs.
    """

    def __init__(self, req_ids: list[str], sampled_req_ids: list[str],
                 host_ids: Optional[torch.Tensor | list[int]], ready: Optional[torch.cuda.Event],
                 logprobs: Optional[dict[str, LogprobsLists]] = None,
                 prompt_logprobs: Optional[dict[str, LogprobsLists]] = None) -> None:
        self._req_ids = req_ids
        self._sampled_req_ids = sampled_req_ids
        self._host_ids = host_ids
        self._ready = ready
        self._logprobs = logprobs or {}
        self._prompt_logprobs = prompt_logprobs or {}
        self._sampled: list[int] = []
        """The sampled ids, in ``sampled_req_ids`` order (once read)."""
        self._output: Optional[ModelRunnerOutput] = None
        self._sample: Optional[Callable[[], None]] = None
        """Samples a launched step that has not sampled yet (``unsampled``); None once it has."""

    @classmethod
    def unsampled(cls, req_ids: list[str], sample: Callable[[], None]) -> "PendingOutput":
        """A launched step whose sampling waits (a constrained step, ``ModelRunner.execute_async``):
        ``sample()`` samples it and ``adopt``s the sampled result into this handle; ``get`` calls it first
        when the runner has not yet."""
        p = cls(req_ids, [], None, None)
        p._sample = sample
        return p

    def adopt(self, sampled: "PendingOutput") -> None:
        """Become ``sampled``, the result of this unsampled step's sampling."""
        self._sample = None
        self._sampled_req_ids = sampled._sampled_req_ids
        self._host_ids = sampled._host_ids
        self._ready = sampled._ready
        self._logprobs = sampled._logprobs
        self._prompt_logprobs = sampled._prompt_logprobs

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> "PendingOutput":
        """A result already on the host."""
        p = cls(output.req_ids, [], None, None)
        p._output = output
        return p

    @property
    def resolved(self) -> bool:
        """Whether the sampled ids were read (``get`` returns at once)."""
        return self._output is not None

    def get(self) -> ModelRunnerOutput:
        if self._sample is not None:
            self._sample()
        if self._output is None:
            if self._ready is not None:
                self._ready.synchronize()
            host_ids = self._host_ids
            ids = host_ids.tolist() if isinstance(host_ids, torch.Tensor) else (host_ids or [])
            self._sampled = ids
            sampled = {req_id: [token_id] for req_id, token_id in zip(self._sampled_req_ids, ids)}
            self._output = ModelRunnerOutput(
                req_ids=self._req_ids, sampled_token_ids=[sampled.get(r, []) for r in self._req_ids],
                logprobs=self._logprobs, prompt_logprobs=self._prompt_logprobs)
        return self._output

    def sampled_token_ids(self) -> list[int]:
        """The sampled ids in ``sampled_req_ids`` order; waits for them like ``get``."""
        self.get()
        return self._sampled
