"""Messages between the engine's parts, and what the user gets back.

Scheduler -> runner: ``SchedulerOutput``. Runner -> scheduler: ``ModelRunnerOutput``.
Scheduler -> output processor: ``EngineCoreOutput``. Output processor -> user: ``RequestOutput``.

A ``SchedulerOutput`` is final once ``schedule()`` returns it: the step message and everything in it
are frozen (tuples, frozensets and read-only mappings), so every rank of a tensor-parallel engine runs
exactly what the scheduler decided.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Optional

from engine.request import MultiModalFeature
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lora.request import LoRARequest


# ----------------------------------------------------------------------------------------
# Scheduler -> model runner
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has no row for: sent in full once (also after preemption)."""

    req_id: str
    """The sequence's id."""
    all_token_ids: tuple[int, ...]
    """Prompt + outputs so far (outputs non-empty when resuming after preemption)."""
    num_prompt_tokens: int
    """Prompt tokens at the start of ``all_token_ids``."""
    sampling_params: SamplingParams
    """The sequence's resolved sampling parameters."""
    block_ids: tuple[int, ...]
    """Every KV block of the request, in order (of KV cache group 0, with several groups)."""
    cross_block_ids: tuple[int, ...]
    """Blocks for the cross-attention K/V of its encoder input, in position order (encoder-decoder
    models; empty otherwise). Allocated at admission, written by the runner before token 0."""
    num_computed_tokens: int
    """Tokens whose KV is already in ``block_ids`` (prefix-cache hits)."""
    lora_slot: int = -1
    """GPU slot of the request's adapter (NO_LORA = -1)."""
    mm_features: tuple[MultiModalFeature, ...] = ()
    """The request's media items, in prompt order."""
    eos_token_ids: frozenset[int] = frozenset()
    """Ids the sampler masks while fewer than min_tokens outputs exist (empty with ignore_eos)."""
    group_block_ids: tuple[tuple[int, ...], ...] = ()
    """The blocks of KV cache groups 1.. (``engine.kv_cache_groups``), one tuple per group; empty with one
    group."""


@dataclass(frozen=True)
class CachedRequestData:
    """Deltas for requests the runner already holds, one entry per scheduled request."""

    req_ids: tuple[str, ...] = ()
    """The scheduled requests the runner already holds, in the scheduler's order."""
    new_block_ids: tuple[tuple[int, ...], ...] = ()
    """Blocks appended this step (often empty; of KV cache group 0, with several groups)."""
    num_computed_tokens: tuple[int, ...] = ()
    """Computed tokens before this step's tokens."""
    lora_slots: tuple[int, ...] = ()
    """Current slot of each request's adapter (slots can move between steps)."""
    new_group_block_ids: tuple[tuple[tuple[int, ...], ...], ...] = ()
    """Blocks appended this step in KV cache groups 1.. (``engine.kv_cache_groups``), per request one tuple per
    group; empty with one group."""


@dataclass(frozen=True)
class LoRASlotLoad:
    """Copy an adapter into a GPU slot before running the step (the scheduler grants it only for an
    adapter whose weights are in host memory: ``Scheduler``'s ``lora_ready``)."""

    lora_slot: int
    """The slot, 0..max_loras-1."""
    lora_request: "LoRARequest"
    """The adapter (name and path; no weights)."""
    prefetch: bool = False
    """For a request a later step admits (``Scheduler._prefetch_lora_slots``, only in steps that run
    tokens): no request of this step reads the slot, so on CUDA the copy may finish after this step's
    forward (the next step waits for it)."""
    pages: tuple[int, ...] = ()
    """With a pool of rank rows (``--max-lora-pool-bytes``): the pool pages the adapter's rank rows go to,
    in order (the slot's page table, ``lora.rank_pool``); empty: padded slots."""


@dataclass(frozen=True)
class SchedulerOutput:
    """One step, decided: what to compute, where KV goes, which adapters sit where. Frozen, and its
    mappings are read-only views (``MappingProxyType``, no copies)."""

    scheduled_new_reqs: tuple[NewRequestData, ...]
    """Requests sent in full this step (admitted, or resumed after preemption)."""
    scheduled_cached_reqs: CachedRequestData
    """Deltas of the scheduled requests the runner already holds."""
    num_scheduled_tokens: Mapping[str, int]
    """req_id -> tokens computed this step."""
    total_num_scheduled_tokens: int
    """Sum of ``num_scheduled_tokens``."""
    finished_req_ids: frozenset[str] = frozenset()
    """Requests that ended since the last step: the runner drops their state."""
    preempted_req_ids: frozenset[str] = frozenset()
    """Requests preempted this step: the runner drops their row, keeps their generator."""
    lora_loads: tuple[LoRASlotLoad, ...] = ()
    """Adapters to copy into slots before this step."""
    scheduled_encoder_inputs: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """req_id -> indices into its mm_features whose encoder runs this step (before the step's forward;
    a request preempted this step keeps its entry: other requests may read the output)."""
    free_encoder_identifiers: tuple[str, ...] = ()
    """Encoder outputs evicted from the cache: the runner drops them before this step runs."""
    structured_output_req_ids: frozenset[str] = frozenset()
    """Constrained requests that sample a token this step: the runner masks their logits rows with the
    grammar bitmask it asks for once the forward is launched (``engine.runner.grammar_mask``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_scheduled_tokens", MappingProxyType(self.num_scheduled_tokens))
        object.__setattr__(self, "scheduled_encoder_inputs", MappingProxyType(self.scheduled_encoder_inputs))

    def __reduce__(self) -> tuple:
        # A read-only mapping does not pickle (a tensor-parallel engine broadcasts each step): its dict does.
        return (SchedulerOutput, (self.scheduled_new_reqs, self.scheduled_cached_reqs,
                                  dict(self.num_scheduled_tokens), self.total_num_scheduled_tokens,
                                  self.finished_req_ids, self.preempted_req_ids, self.lora_loads,
                                  dict(self.scheduled_encoder_inputs), self.free_encoder_identifiers,
                                  self.structured_output_req_ids))


# ----------------------------------------------------------------------------------------
# Model runner -> scheduler
# ----------------------------------------------------------------------------------------
@dataclass
class LogprobsLists:
    """Logprobs of sampled (or prompt) positions, as host lists.

    Row i: ``token_ids[i][0]`` is the sampled (or actual prompt) token and ``logprobs[i][0]`` its
    logprob; the remaining entries are the top-N in descending order.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]
    """1-based rank of the sampled token among all tokens."""


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    """Per request in ``req_ids``: [] while a prefill chunk is unfinished, else [token]."""
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    """req_id -> logprobs of this step's sampled token (only requests asking for them)."""
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    """req_id -> logprobs of this step's prompt tokens (the first prompt token has none)."""


# ----------------------------------------------------------------------------------------
# Scheduler -> output processor
# ----------------------------------------------------------------------------------------
@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[LogprobsLists] = None
    new_prompt_logprobs: Optional[LogprobsLists] = None
    finish_reason: Optional[str] = None
    """None while running; 'stop', 'length', 'abort' or 'error' once finished."""
    stop_reason: Optional[int | str] = None
    """The stop token id or stop string that ended the request."""
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    """A snapshot after each step, for /metrics and tests."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    """Fraction of KV blocks in use, 0..1."""
    prefix_cache_queries: int = 0
    """Tokens looked up in the prefix cache since start."""
    prefix_cache_hits: int = 0
    """Of those, tokens found."""
    num_preemptions: int = 0
    """Preemptions since start."""
    num_steps: int = 0
    max_reqs_per_step: int = 0
    """Most requests scheduled in one step since start (proves batching)."""
    num_scheduled_tokens: int = 0
    """Tokens of the last step."""
    num_active_loras: int = 0
    """Adapters in GPU slots."""
    encoder_cache_usage: float = 0.0
    """Fraction of the encoder cache's embeddings held by entries, 0..1."""
    encoder_cache_queries: int = 0
    """Media items looked up in the encoder cache since start."""
    encoder_cache_hits: int = 0
    """Of those, found already encoded (or being encoded this step)."""
    # Resources held now (leak checks: all 0 on an idle engine, ``benchmarks/soak.py``).
    num_kv_blocks_in_use: int = 0
    """KV blocks held by requests; a prefix-cached block nobody holds counts as free."""
    num_kv_blocks: int = 0
    """KV blocks that can be handed out (all but the reserved null block)."""
    num_lora_slots_in_use: int = 0
    """Adapter GPU slots with running requests (idle resident adapters not counted)."""
    num_lora_slots: int = 0
    """Adapter GPU slots (``max_loras``; 0 without LoRA)."""
    num_loras_registered: int = 0
    """Adapters the engine knows (host copies), those being unloaded included."""
    num_lora_slot_loads: int = 0
    """Adapters copied into a GPU slot since start (prefetches included)."""
    num_lora_slot_evictions: int = 0
    """Of those, loads that evicted another (idle) adapter from its slot."""
    num_lora_slot_prefetches: int = 0
    """Of those, loads for a request admitted in a later step."""
    num_lora_reloads_while_running: int = 0
    """Slot loads that evicted or reloaded an adapter with running requests (never: a check that stays 0)."""
    num_lora_host_loads: int = 0
    """Adapters put in the host store (``max_cpu_loras``) since start (a read again after eviction counts again)."""
    num_lora_host_evictions: int = 0
    """Adapters the host store dropped for room since start."""
    num_lora_disk_reads: int = 0
    """Adapter reads the engine's loader threads finished since start (failed ones included)."""
    lora_disk_read_bytes: int = 0
    """Bytes of the adapter weights those reads returned."""
    lora_disk_read_s: float = 0.0
    """Sum over those reads of each one's seconds on its thread (file to prepared, page-locked tensors)."""
    lora_disk_read_queued_s: float = 0.0
    """Sum over those reads of the seconds each waited for a loader thread."""
    lora_rank_row_bytes: int = 0
    """Device bytes of one adapter rank row over every adapted layer (``LoRAManager.row_bytes``)."""
    num_lora_step_rank_rows: int = 0
    """Sum over steps of the rank rows of each step's distinct adapters (the least its LoRA kernels read;
    times ``lora_rank_row_bytes``: the adapter bytes the steps had to read)."""
    num_encoder_cache_entries: int = 0
    """Encoder outputs held, referenced or kept for reuse."""
    num_encoder_cache_entries_in_use: int = 0
    """Of those, referenced by a request."""
    num_encoder_cache_embeds_in_use: int = 0
    """Encoder embeddings of the referenced entries."""
    encoder_cache_size: int = 0
    """Encoder embeddings the cache holds at most."""


# ----------------------------------------------------------------------------------------
# Output processor -> user (vLLM's public shapes)
# ----------------------------------------------------------------------------------------
@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[SampleLogprobs]
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None
    lora_request: Optional["LoRARequest"] = None
    error: Optional[BaseException] = None
    """Why the engine ended this request early, None for every request it ran to the end: the
    ``EngineStepError`` of a step that failed (HTTP 500) or the LoRA error of an adapter that could not
    be read again (4xx). Set on the request's final output only; its sequences that the error ended
    have finish_reason 'error' (vLLM's), those it cut short beside them (``n`` > 1) 'abort'."""
