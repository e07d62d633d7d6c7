"""Messages between the engine's parts, and what the user gets back.

Scheduler -> runner: ``SchedulerOutput``. Runner -> scheduler: ``ModelRunnerOutput``.
Scheduler -> output processor: ``EngineCoreOutput``. Output processor -> user: ``RequestOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from engine.request import MultiModalFeature
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lora.request import LoRARequest


# ----------------------------------------------------------------------------------------
# Scheduler -> model runner
# ----------------------------------------------------------------------------------------
@dataclass
class NewRequestData:
    """A request the runner has no row for: sent in full once (also after preemption)."""

    req_id: str
    all_token_ids: list[int]
    """Prompt + outputs so far (outputs non-empty when resuming after preemption)."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    """Every KV block of the request, in order."""
    cross_block_ids: list[int]
    """Blocks for the cross-attention K/V of its encoder input, in position order (encoder-decoder
    models; empty otherwise). Allocated at admission, written by the runner before token 0."""
    num_computed_tokens: int
    """Tokens whose KV is already in ``block_ids`` (prefix-cache hits)."""
    lora_slot: int = -1
    """GPU slot of the request's adapter (NO_LORA = -1)."""
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    eos_token_ids: set[int] = field(default_factory=set)
    """Ids the sampler masks while fewer than min_tokens outputs exist (empty with ignore_eos)."""


@dataclass
class CachedRequestData:
    """Deltas for requests the runner already holds, one entry per scheduled request."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    """Blocks appended this step (often empty)."""
    num_computed_tokens: list[int] = field(default_factory=list)
    """Computed tokens before this step's tokens."""
    lora_slots: list[int] = field(default_factory=list)
    """Current slot of each request's adapter (slots can move between steps)."""


@dataclass
class LoRASlotLoad:
    """Copy an adapter into a GPU slot before running the step."""

    lora_slot: int
    lora_request: "LoRARequest"


@dataclass
class SchedulerOutput:
    """One step, decided: what to compute, where KV goes, which adapters sit where."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """req_id -> tokens computed this step."""
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests that ended since the last step: the runner drops their state."""
    preempted_req_ids: set[str] = field(default_factory=set)
    """Requests preempted this step: the runner drops their row, keeps their generator."""
    lora_loads: list[LoRASlotLoad] = field(default_factory=list)
    """Adapters to copy into slots before this step."""
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    """req_id -> indices into its mm_features whose encoder runs this step (before the step's forward;
    a request preempted this step keeps its entry: other requests may read the output)."""
    free_encoder_identifiers: list[str] = field(default_factory=list)
    """Encoder outputs evicted from the cache: the runner drops them before this step runs."""


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
