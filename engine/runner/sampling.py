"""``StepSampler``: a step's logits -> its sampled ids (left on the device, copied to the host without a
wait), with the model's logits rules, sampling metadata reused across steps, logprobs and prompt logprobs."""

from __future__ import annotations

from typing import Optional

import torch

from engine.input_batch import CachedRequestState, StepInputs
from engine.models.interfaces import LogitsRules, ModelForCausalLM
from engine.outputs import LogprobsLists
from engine.runner.pending import PendingOutput
from engine.sampler import Sampler, TokenBitmask, compute_prompt_logprobs
from engine.sampling_metadata import SamplingMetadata, build_sampling_metadata
from engine.sampling_params import SamplingParams
from kernels.cpu_token_bitmask import CpuTokenBitmask


_STARTED: tuple[list[int], list[int]] = ([], [-1])
"""The logits rules' output placeholders of rows whose rules read no history: before / after their first id."""


def sampling_is_simple(p: SamplingParams) -> bool:
    """Sampling that needs no token history on the host (no penalties, no min_tokens)."""
    return (p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
            and p.min_tokens == 0)


class StepSampler:
    """Args:
        model: computes prompt logprobs' logits (``compute_logits``).
        vocab_size: logits per row.
        device: where the step runs.
        logprobs_mode: ``ModelConfig.logprobs_mode``.
        logits_rules: the model's logits rules (None: none).
        cpu_bitmask: the C kernel that applies grammar bitmasks to CPU logits (None: xgrammar's).
    """

    def __init__(self, model: ModelForCausalLM, vocab_size: int, device: torch.device, logprobs_mode: str,
                 logits_rules: Optional[LogitsRules], cpu_bitmask: Optional[CpuTokenBitmask] = None) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.device = device
        self.logprobs_mode = logprobs_mode
        self.logits_rules = logits_rules
        self.sampler = Sampler(cpu_bitmask)
        self.last_sampled: Optional[tuple[torch.Tensor, dict[str, int]]] = None
        """The last sampling step's ids [num_sampled] on the device, and each request's row in them (the next
        step's input ids the host does not have yet)."""
        self._metadata_cache: Optional[tuple[tuple[str, ...], SamplingMetadata]] = None

    def sample(self, inputs: StepInputs, logits: torch.Tensor, states: list[CachedRequestState],
               prompt_logprobs: dict[str, LogprobsLists],
               num_generated: Optional[dict[str, int]] = None,
               token_bitmask: Optional[TokenBitmask] = None) -> PendingOutput:
        """Sample ``states`` (the step's sampling requests) from ``logits`` [num_sampled, vocab] and start the
        ids' copy to the host. ``num_generated``: req_id -> output tokens before this step's sample (with
        logits rules only). ``token_bitmask``: the grammars of the constrained rows (None: none)."""
        if self.logits_rules is not None:
            # Rows whose rules read no history get a placeholder: [] before their first id, else [-1] (their
            # last id may be in flight).
            outputs = [s.output_token_ids if s.rules_need_history else _STARTED[num_generated[s.req_id] > 0]
                       for s in states]
            prompts = [s.token_ids[:s.num_prompt_tokens] for s in states]
            logits = self.logits_rules.apply(logits, prompts, outputs)
        out = self.sampler(logits, self._metadata(states), to_host=False, token_bitmask=token_bitmask)
        self.last_sampled = (out.sampled_token_ids, {s.req_id: i for i, s in enumerate(states)})
        logprobs = {}
        if out.logprobs is not None:
            for i, s in enumerate(states):
                if s.sampling_params.logprobs is not None:
                    n = s.sampling_params.logprobs + 1
                    logprobs[s.req_id] = LogprobsLists(token_ids=[out.logprobs.token_ids[i][:n]],
                                                       logprobs=[out.logprobs.logprobs[i][:n]],
                                                       ranks=[out.logprobs.ranks[i]])
        if out.sampled_token_id_list is not None:
            host_ids, ready = out.sampled_token_id_list, None
        elif self.device.type == "cuda":
            host_ids = torch.empty(len(states), dtype=torch.int64, pin_memory=True)   # [num_sampled]
            host_ids.copy_(out.sampled_token_ids, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host_ids, ready = out.sampled_token_ids.tolist(), None
        return PendingOutput(inputs.req_ids, inputs.sample_req_ids, host_ids, ready, logprobs,
                             prompt_logprobs)

    def _metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        """The step's sampling tensors; reused while the same requests sample with simple params."""
        key = tuple(s.req_id for s in states)
        simple = all(sampling_is_simple(s.sampling_params) for s in states)
        if simple and self._metadata_cache is not None and self._metadata_cache[0] == key:
            return self._metadata_cache[1]
        if simple:
            prompts = outputs = [[] for _ in states]   # only penalties and min_tokens read them
        else:
            prompts = [s.token_ids[:s.num_prompt_tokens] for s in states]
            outputs = [s.output_token_ids for s in states]
        meta = build_sampling_metadata(
            [s.sampling_params for s in states], [s.generator for s in states], prompts, outputs,
            [s.eos_token_ids for s in states], self.vocab_size, self.device, self.logprobs_mode)
        self._metadata_cache = (key, meta) if simple else None
        return meta

    def prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor,
                        requests: dict[str, CachedRequestState]) -> dict[str, LogprobsLists]:
        """req_id -> the logprobs of its prompt tokens this step scores
        (``StepInputs.prompt_logprob_ranges``), from the step's hidden states [T, hidden]."""
        out: dict[str, LogprobsLists] = {}
        for rid, (start, count, first_pos) in inputs.prompt_logprob_ranges.items():
            s = requests[rid]
            logits = self.model.compute_logits(hidden[start:start + count])   # [count, vocab]
            targets = torch.tensor(s.token_ids[first_pos:first_pos + count], device=self.device)
            out[rid] = compute_prompt_logprobs(logits, targets, s.sampling_params.prompt_logprobs)
        return out
