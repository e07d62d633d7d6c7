"""Engine-side request: what the scheduler tracks per sequence (ints and ids, no tensors)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lora.request import LoRARequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> Optional[str]:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class PlaceholderRange:
    """Where one media item's embeddings sit in the prompt."""

    offset: int
    """Index of the first placeholder token in the prompt."""
    length: int
    """Number of placeholder tokens (= encoder output rows for this item)."""


@dataclass
class MultiModalFeature:
    """One media item of a request, as the scheduler and runner see it.

    Two kinds: a media item merged into the prompt (``placeholder`` set: its encoder rows replace
    the placeholder tokens' embeddings), and an encoder-decoder input (``placeholder`` None, e.g.
    Whisper's audio): the decoder reads it through cross-attention, whose K/V the runner computes
    from the encoder output before the request's first token and keeps in the request's cross
    blocks; the encoder output is needed only by the step that computes token 0.
    """

    modality: str
    """'image' or 'audio'."""
    identifier: str
    """The encoder-cache key and the prefix-cache extra key, final when the processor returns: the content
    hash, with the adapter's name when the request's adapter updates the encoder (``with_encoder_adapter``,
    decided by ``Processor.encoder_keyed``)."""
    placeholder: Optional[PlaceholderRange]
    """Where its embeddings sit in the prompt; None for a cross-attention input."""
    data: Any = None
    """Processed encoder inputs (e.g. pixel_values); only the runner reads them."""
    num_cross_embeds: int = 0
    """Encoder output rows of a cross-attention input (``placeholder`` None); 0 otherwise."""
    encoder_lora_name: Optional[str] = None
    """The adapter the encoder runs for this item (the request's, when it updates encoder
    projections); None: the base encoder, whose output requests of any other adapter share."""

    def with_encoder_adapter(self, lora_name: str, lora_int_id: int) -> "MultiModalFeature":
        """This item encoded under adapter ``lora_name`` (loaded as ``lora_int_id``): a copy whose encoder-cache
        key carries both, as the prefix cache's adapter key does, so the same media under two such adapters is
        encoded twice and never shares the base output, and an adapter loaded again under the same name (the
        server gives every load a new id) never reads the encoder outputs of the one it replaced."""
        assert self.encoder_lora_name is None, "an item is encoded under one adapter"
        return replace(self, identifier=f"{self.identifier}+lora:{lora_name}#{lora_int_id}",
                       encoder_lora_name=lora_name)

    @property
    def num_embeds(self) -> int:
        """Encoder output rows (the encoder budget and cache size of this item)."""
        return self.num_cross_embeds if self.placeholder is None else self.placeholder.length

    @property
    def needed_range(self) -> tuple[int, int]:
        """Token range [start, end) of the request whose computation needs the encoder output:
        the placeholder, or token 0 for a cross-attention input (its K/V are written before it)."""
        if self.placeholder is None:
            return 0, 1
        return self.placeholder.offset, self.placeholder.offset + self.placeholder.length


@dataclass
class EngineRequest:
    """What the processor hands the engine: a validated, tokenized request."""

    request_id: str
    prompt: Optional[str]
    """The prompt text when the user gave text (echoed back in RequestOutput)."""
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: set[int]
    """Token ids that end generation unless ignore_eos (tokenizer eos + generation_config eos)."""
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    lora_request: Optional["LoRARequest"] = None
    cache_salt: Optional[str] = None
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    max_tokens: int = 16
    """Resolved output cap: min(sampling max_tokens, max_model_len - prompt_len)."""


class Request:
    """One sequence as the scheduler sees it.

    ``num_computed_tokens`` chases ``num_tokens``: each step the scheduler hands out tokens so
    the computed count catches up with prompt + outputs. That one rule covers chunked prefill,
    prefix-cache hits, decodes and recompute after preemption.
    """

    def __init__(self, req: EngineRequest) -> None:
        self.request_id = req.request_id
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.sampling_params = req.sampling_params
        self.eos_token_ids = req.eos_token_ids
        self.arrival_time = req.arrival_time
        self.priority = req.priority
        self.lora_request = req.lora_request
        self.cache_salt = req.cache_salt
        self.mm_features = req.mm_features
        self.max_tokens = req.max_tokens

        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[int | str] = None
        self.output_token_ids: list[int] = []
        # prompt + outputs; appended in place as tokens arrive.
        self.all_token_ids: list[int] = list(req.prompt_token_ids)
        self.num_computed_tokens = 0
        # Async scheduling: tokens scheduled to be sampled whose ids have not come back yet. The
        # scheduler treats them as known (it schedules their positions one step ahead); the runner
        # feeds their ids from the device; update_from_output swaps each for the real id.
        self.num_output_placeholders = 0
        # Tokens served from the prefix cache at first scheduling (-1 until then).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Chained hashes of the full blocks of all_token_ids (filled by the KV cache manager).
        self.block_hashes: list[int] = []
        # Timestamps (time.time()) for stats.
        self.scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.finished_time: Optional[float] = None

    # --- derived counts -------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_cross_tokens(self) -> int:
        """Encoder positions its decoder cross-attends to (KV held in cross blocks); 0 for decoder-only."""
        return sum(f.num_cross_embeds for f in self.mm_features if f.placeholder is None)

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> Optional[str]:
        return RequestStatus.finish_reason(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __lt__(self, other: "Request") -> bool:
        # Priority order: lower value first, then earlier arrival, then id.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority, other.arrival_time, other.request_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
