"""The scheduler: one token budget per step over running and waiting requests.

Pure Python over ints and ids. It decides which tokens each request computes, which KV blocks
hold them and which LoRA slot each adapter sits in; the runner only does what the resulting
``SchedulerOutput`` says.

Constrained requests (``SamplingParams.structured_outputs``) are tracked by the engine's
``StructuredOutputManager`` (``engine.structured_output.manager``): admitted once their grammar is
compiled (others are scheduled meanwhile), their sampled tokens fed to their matcher in
``update_from_output`` (a grammar that ends finishes the request with ``stop``), their matcher freed with
them. A grammar that fails to compile or a token it rejects ends the request with a
``StructuredOutputError`` (``take_failed``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from engine.config import CacheConfig, LoRAConfig, SchedulerConfig
from engine.encoder_cache_manager import EncoderCacheManager
from engine.kv_cache_manager import KVCacheManager, group_lists
from engine.outputs import (CachedRequestData, EngineCoreOutput, LoRASlotLoad, ModelRunnerOutput,
                            NewRequestData, SchedulerOutput, SchedulerStats)
from engine.request import Request, RequestStatus
from engine.request_queue import create_request_queue
from engine.structured_output.errors import StructuredOutputError
from engine.structured_output.manager import AcceptStatus
from lora import NO_LORA
from lora.slot_manager import LoRASlotManager, RankPagePool, SlotGrant
from lora.request import LoRARequest

if TYPE_CHECKING:
    from engine.structured_output.manager import GrammarBitmask, ReasoningTracker, StructuredOutputManager

logger = logging.getLogger("chorus.scheduler")


LORA_RESERVE_AFTER_STEPS = 0
"""Steps a waiting LoRA request may go without a slot before it reserves one (see
``Scheduler._lora_admissible``)."""


@dataclass
class _StepPlan:
    """What one ``schedule()`` call has decided so far."""

    token_budget: int
    """Tokens still available this step."""
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    """req_id -> tokens this step."""
    new_reqs: list[Request] = field(default_factory=list)
    """Admitted from waiting this step (fresh or resumed after preemption)."""
    running_reqs: list[Request] = field(default_factory=list)
    """Already running, scheduled again."""
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    """req_id -> blocks allocated this step (running requests)."""
    preempted: list[Request] = field(default_factory=list)
    lora_loads: list[LoRASlotLoad] = field(default_factory=list)
    encoder_budget: int = 0
    """Encoder embeddings still available this step."""
    encoder_inputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """req_id -> indices of its media items encoded this step."""


@dataclass
class _LoRAReservation:
    """Anti-starvation state: the oldest waiting LoRA request that could not get a slot."""

    req_id: str
    """The request the next free slot is reserved for."""
    drain_slot: int
    """Slot that admits no new requests until it is idle (so it frees up for ``req_id``)."""


class Scheduler:
    """Continuous batching with chunked prefill, prefix caching, recompute preemption and
    LoRA slot assignment.

    Args:
        scheduler_config: token budget, max running requests, policy, chunk cap.
        cache_config: block size and prefix caching.
        max_model_len: prompt + output tokens per request at most.
        num_kv_blocks: KV blocks in the cache, including the reserved null block 0.
        lora_config: adapter slots; None when adapters are disabled.
        lora_ready: whether an adapter's weights are in host memory, so that a step may load it into a
            slot (the engine's ``LoRAManager.host_ready``, which has a missing one read off the step
            loop); a waiting request whose adapter needs a slot and is not ready waits, and a step's
            ``lora_loads`` name only ready adapters. None: every adapter is ready.
        max_embeds_per_mm_item: encoder embeddings of the largest media item the model can produce
            (0: a text-only model); sizes the encoder budget and cache (``SchedulerConfig.encoder_budgets``).
        structured_output: the engine's ``StructuredOutputManager``; None: a request with
            ``structured_outputs`` is refused.
        sliding_window: every layer of the model attends within this many positions: KV blocks before a
            running request's window go back to the pool (``KVCacheManager``); None: none slides. Ignored
            with ``kv_group_windows``.
        kv_group_windows: each KV cache group's window (``engine.kv_cache_groups``, the runner's
            ``KVCache.groups``); None: one group of window ``sliding_window``.
        whole_media_chunks: a prefill chunk never ends inside a media item's placeholder (its tokens
            attend to each other both ways, e.g. Gemma 3's images), and an item longer than the token
            budget is refused.
        lora_pool: the pages of adapter rank rows the slots share (``LoRAManager.rank_pool``); None:
            padded slots.
        lora_rank: an adapter's rank, which sets its pages (``LoRAManager.adapter_rank``; asked once
            it is ready).
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 max_model_len: int, num_kv_blocks: int,
                 lora_config: Optional[LoRAConfig] = None,
                 lora_ready: Optional[Callable[[LoRARequest], bool]] = None,
                 max_embeds_per_mm_item: int = 0,
                 structured_output: Optional["StructuredOutputManager"] = None,
                 new_reasoning_tracker: Optional[Callable[[Request], Optional["ReasoningTracker"]]] = None,
                 sliding_window: Optional[int] = None, whole_media_chunks: bool = False,
                 lora_pool: Optional[RankPagePool] = None,
                 lora_rank: Optional[Callable[[LoRARequest], int]] = None,
                 kv_group_windows: Optional[Sequence[Optional[int]]] = None) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            self.block_size, num_kv_blocks, max_model_len, cache_config.enable_prefix_caching,
            sliding_window, scheduler_config.max_num_batched_tokens, kv_group_windows)
        self.whole_media_chunks = whole_media_chunks
        self.lora_config = lora_config
        self.lora_slots = (LoRASlotManager(lora_config.max_loras, lora_pool) if lora_config is not None
                           else None)
        self.lora_rank = lora_rank
        self._lora_reservation: Optional[_LoRAReservation] = None
        # req_id -> step at which a waiting LoRA request first found no slot.
        self._lora_blocked_since: dict[str, int] = {}
        self.lora_reserve_after_steps = LORA_RESERVE_AFTER_STEPS
        self.lora_ready = lora_ready
        self._lora_not_ready: set[str] = set()
        """Adapters ``lora_ready`` answered False for in this ``schedule()`` (asked once a step)."""
        self.num_lora_reloads_while_running = 0
        """Slot loads that evicted or reloaded an adapter some running request uses (a check: always 0)."""
        self.num_lora_step_rank_rows = 0
        """Sum over steps of the rank rows of the step's distinct adapters: the least the steps' LoRA kernels
        read (times the model's bytes per rank row; ``SchedulerStats.num_lora_step_rank_rows``)."""
        self.encoder_compute_budget, encoder_cache_size = scheduler_config.encoder_budgets(max_embeds_per_mm_item)
        self.encoder_cache_manager = EncoderCacheManager(encoder_cache_size)

        # Every unfinished request by id.
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        # Running requests in admission order (the back is preempted first under fcfs).
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(): the runner drops their rows.
        self.finished_req_ids: set[str] = set()
        self.structured_output = structured_output
        self.new_reasoning_tracker = new_reasoning_tracker
        """With a reasoning parser: the tracker of a constrained request's reply (None: it does not
        reason), so that its grammar constrains only what follows the reasoning."""
        self._failed: dict[str, BaseException] = {}
        """Requests ended with a ``StructuredOutputError`` since the last ``take_failed()``."""

        # Counters for get_stats().
        self.num_preemptions = 0
        self.num_steps = 0
        self.max_reqs_per_step = 0
        self.last_num_scheduled_tokens = 0

    # ----------------------------------------------------------------------------------
    # Admission
    # ----------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or raise ValueError if it could never run."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"Request id {rid!r} is already in use.")
        prompt_len = request.num_prompt_tokens
        if prompt_len + 1 > self.max_model_len:
            raise ValueError(
                f"Request {rid!r}: the prompt has {prompt_len} tokens but max_model_len="
                f"{self.max_model_len} leaves no room for one output token; shorten the prompt "
                "or raise max_model_len.")
        for feature in request.mm_features:
            # NOTE: the budget is at most the cache size, so an item within it always fits both.
            if feature.num_embeds > self.encoder_compute_budget:
                raise ValueError(
                    f"Request {rid!r}: a {feature.modality} of {feature.num_embeds} embeddings exceeds "
                    f"the encoder budget of {self.encoder_compute_budget} embeddings per step; send a smaller "
                    "one or raise --max-num-encoder-input-tokens (and --encoder-cache-size).")
            if self.whole_media_chunks and feature.num_embeds > self._max_chunk_tokens():
                raise ValueError(
                    f"Request {rid!r}: a {feature.modality} of {feature.num_embeds} tokens is computed in one "
                    f"prefill chunk, longer than the {self._max_chunk_tokens()} tokens a step computes for a "
                    "request; raise --max-num-batched-tokens (and --long-prefill-token-threshold).")
        if request.lora_request is not None and self.lora_slots is None:
            raise ValueError(f"Request {rid!r} names adapter {request.lora_request.lora_name!r} but "
                             "LoRA is disabled; start the engine with a LoRA config (--enable-lora).")
        max_total_tokens = min(prompt_len + request.max_tokens, self.max_model_len)
        # NOTE: the last sampled token never gets KV, hence the -1.
        num_cross = request.num_cross_tokens
        if not self.kv_cache_manager.can_fit_ever(max_total_tokens - 1, num_cross):
            n, groups = self.kv_cache_manager.num_usable_blocks, self.kv_cache_manager.num_groups
            cross = f" + {num_cross} encoder positions of cross-attention K/V" if num_cross else ""
            per_group = f" of each of {groups} KV cache groups" if groups > 1 else ""
            raise ValueError(
                f"KV cache has {n} blocks of {self.block_size} tokens ({n * self.block_size // groups} tokens"
                f"{per_group}); "
                f"request {rid!r} needs up to {max_total_tokens} tokens{cross} (prompt {prompt_len} + "
                f"max_tokens {request.max_tokens}, within max_model_len {self.max_model_len}); raise kv_cache_space / gpu_memory_utilization / "
                "num_gpu_blocks_override or lower max_tokens / max_model_len.")
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            if self.structured_output is None:
                raise ValueError(f"{constraint.param}: this engine has no constrained decoding.")
            tracker = self.new_reasoning_tracker(request) if self.new_reasoning_tracker is not None else None
            self.structured_output.add_request(rid, constraint, reasoning=tracker)
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self.waiting.add_request(request)

    # ----------------------------------------------------------------------------------
    # schedule()
    # ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide one step.

        Algorithm: no prefill/decode phases; each request's ``num_computed_tokens`` chases
        its ``num_tokens``.
        (1) RUNNING requests first, in order: each gets min(remaining, budget,
            long_prefill_token_threshold). When KV blocks run out, preempt (free, recompute
            later) the back of ``running`` (fcfs) or the worst-ranked request (priority),
            giving back its tokens if it was already scheduled; if the victim is the request
            itself, move on (under fcfs it was the last one).
        (2) Only if nothing was preempted: WAITING requests in queue order while budget and
            ``max_num_seqs`` allow: take prefix-cache hits, check the LoRA slot (a request
            whose adapter cannot get one is skipped without blocking those behind it; see
            ``_lora_admissible`` for the anti-starvation rule), allocate blocks for the chunk
            (admitting only if the whole current sequence fits), stop at the first request
            that does not fit.
        (3) Emit new requests in full, known ones as deltas, then advance
            ``num_computed_tokens`` right away so the next step continues the chunk.
        A constrained request waits (skipped, holding nothing) while its grammar compiles; one whose
        grammar failed ends with the compiler's error (``take_failed``).
        Async scheduling: a request whose step reaches the end of its tokens gets an output
        placeholder (``num_output_placeholders``), counted as a known token, so the next
        ``schedule()`` may run before this step's ``update_from_output()`` and schedule the
        placeholder's position (the runner takes its id from the device). A request whose
        placeholders already reach ``max_tokens`` is not scheduled again.
        """
        self._validate_lora_reservation()
        self._lora_not_ready.clear()
        plan = _StepPlan(token_budget=self.scheduler_config.max_num_batched_tokens,
                         encoder_budget=self.encoder_compute_budget)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
            self._prefetch_lora_slots(plan)
        output = self._build_output(plan, self._constrained_sampling(plan))
        for req_id, n in plan.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1   # this step samples a token
            if request.mm_features and request.num_computed_tokens - n < request.num_prompt_tokens:
                self._release_consumed_encoder_inputs(request)   # this step computed prompt tokens
        self.finished_req_ids = set()
        self.num_steps += 1
        self.max_reqs_per_step = max(self.max_reqs_per_step, len(plan.num_scheduled_tokens))
        self.last_num_scheduled_tokens = output.total_num_scheduled_tokens
        return output

    def _constrained_sampling(self, plan: _StepPlan) -> frozenset[str]:
        """The constrained requests of the step whose tokens reach the end of their sequence: they sample
        (``num_computed_tokens`` is not advanced yet)."""
        if self.structured_output is None or not self.structured_output.num_requests():
            return frozenset()
        out = []
        for req_id, n in plan.num_scheduled_tokens.items():
            request = self.requests[req_id]
            if (self.structured_output.is_constrained(req_id) and request.num_computed_tokens + n
                    >= request.num_tokens + request.num_output_placeholders):
                out.append(req_id)
        return frozenset(out)

    def _num_new_tokens(self, request: Request, num_computed: int, token_budget: int) -> int:
        n = request.num_tokens + request.num_output_placeholders - num_computed
        threshold = self.scheduler_config.long_prefill_token_threshold
        if threshold > 0:
            n = min(n, threshold)
        return min(n, token_budget, self.max_model_len - 1 - num_computed)

    def _schedule_running(self, plan: _StepPlan) -> None:
        idx = 0
        while idx < len(self.running) and plan.token_budget > 0:
            request = self.running[idx]
            if (request.num_output_placeholders
                    and request.num_output_tokens + request.num_output_placeholders >= request.max_tokens):
                idx += 1   # its in-flight token is its last (async scheduling)
                continue
            n = self._num_new_tokens(request, request.num_computed_tokens, plan.token_budget)
            encoder_inputs: list[int] = []
            if n > 0 and request.mm_features:
                encoder_inputs, n = self._plan_encoder_inputs(request, request.num_computed_tokens, n, plan)
            if n <= 0:
                idx += 1
                continue
            while True:
                new_block_ids = self.kv_cache_manager.allocate_slots(request, n)
                if new_block_ids is not None:
                    break
                victim = self._pick_preemption_victim()
                victim_idx = self.running.index(victim)
                del self.running[victim_idx]
                if victim_idx < idx:
                    idx -= 1
                self._unschedule(plan, victim)
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is request:
                    break
            if new_block_ids is None:
                # The request preempted itself (fcfs: it was last, so this ends the loop).
                # Under priority, better-ranked requests after it may still fit: go on.
                continue
            plan.running_reqs.append(request)
            plan.new_block_ids[request.request_id] = new_block_ids
            plan.num_scheduled_tokens[request.request_id] = n
            plan.token_budget -= n
            self._allocate_encoder_inputs(plan, request, encoder_inputs)
            idx += 1

    def _pick_preemption_victim(self) -> Request:
        if self.scheduler_config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    @staticmethod
    def _unschedule(plan: _StepPlan, request: Request) -> None:
        """Give back a request's tokens if it was already scheduled this step."""
        n = plan.num_scheduled_tokens.pop(request.request_id, None)
        if n is None:
            return
        plan.token_budget += n
        plan.running_reqs.remove(request)
        plan.new_block_ids.pop(request.request_id, None)

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free everything, back to the front of the waiting queue.

        Media items it encodes this step stay scheduled (another request may read them): its
        references go, the entries stay cached until evicted."""
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        if request.lora_request is not None:
            assert self.lora_slots is not None
            self.lora_slots.release(request.lora_request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        skipped: list[Request] = []
        # The first request (in queue order) that needed a new adapter slot and got none.
        first_slotless: Optional[Request] = None
        max_num_seqs = self.scheduler_config.max_num_seqs
        while len(self.waiting) > 0 and plan.token_budget > 0 and len(self.running) < max_num_seqs:
            request = self.waiting.peek_request()
            if request.num_output_placeholders:
                # Preempted while its last token was in flight: resume once the token is back.
                skipped.append(self.waiting.pop_request())
                continue
            if self.structured_output is not None and not self._grammar_ready(request):
                self.waiting.pop_request()
                if not request.is_finished():
                    skipped.append(request)   # still compiling: the requests behind it go on
                continue
            if request.lora_request is not None and not self._lora_admissible(request):
                skipped.append(self.waiting.pop_request())
                if first_slotless is None and self._needs_new_slot(request):
                    first_slotless = request
                continue
            hit_blocks, num_hit_tokens = [], 0
            if request.num_computed_tokens == 0:
                hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_computed = request.num_computed_tokens + num_hit_tokens
            n = self._num_new_tokens(request, num_computed, plan.token_budget)
            encoder_inputs: list[int] = []
            if n > 0 and request.mm_features:
                encoder_inputs, n = self._plan_encoder_inputs(request, num_computed, n, plan)
                if n <= 0:
                    # Its next item cannot be encoded this step (budget or cache space): the
                    # requests behind it go on; it keeps its place in the queue.
                    skipped.append(self.waiting.pop_request())
                    continue
            new_block_ids = None
            if n > 0:
                new_block_ids = self.kv_cache_manager.allocate_slots(
                    request, n, hit_blocks, num_hit_tokens, full_sequence_must_fit=True)
            if new_block_ids is None:
                break
            self.waiting.pop_request()
            self._admit(plan, request, num_computed, n)
            self._allocate_encoder_inputs(plan, request, encoder_inputs)
        self.waiting.prepend_requests(skipped)
        if first_slotless is not None:
            self._maybe_reserve_lora_slot(first_slotless)

    def _grammar_ready(self, request: Request) -> bool:
        """Whether a waiting request's grammar allows scheduling it: unconstrained, or compiled. A grammar
        that failed to compile ends the request (popped from the queue by the caller) with its error."""
        manager = self.structured_output
        rid = request.request_id
        if manager.is_ready(rid):
            return True
        error = manager.error(rid)
        if error is not None:
            param = request.sampling_params.structured_outputs.param
            self._fail_with(request, error.with_param(param).named(), held_slot=False)
        return False

    def _fail_with(self, request: Request, error: StructuredOutputError, held_slot: bool) -> None:
        """End ``request`` with ``error`` (reported by ``take_failed``, not as an output) and free it."""
        request.status = RequestStatus.FINISHED_ERROR
        self._failed[request.request_id] = error
        self._free_request(request, held_slot)

    def _admit(self, plan: _StepPlan, request: Request, num_computed: int, num_new_tokens: int) -> None:
        if request.lora_request is not None:
            assert self.lora_slots is not None
            resident = self.lora_slots.slot_of(request.lora_request.lora_name) is not None
            grant = self.lora_slots.acquire(request.lora_request, {} if resident else self.lora_demand(),
                                            self._lora_rank_of(request.lora_request))
            assert grant is not None, "checked by _lora_admissible"
            if grant.load_needed:
                self._check_slot_load(grant, request.lora_request.lora_name)
                plan.lora_loads.append(LoRASlotLoad(grant.lora_slot, request.lora_request, pages=grant.pages))
            if self._lora_reservation is not None and self._lora_reservation.req_id == request.request_id:
                self._lora_reservation = None
            self._lora_blocked_since.pop(request.request_id, None)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
        if request.scheduled_time is None:
            request.scheduled_time = time.time()
        self.running.append(request)
        plan.new_reqs.append(request)
        plan.num_scheduled_tokens[request.request_id] = num_new_tokens
        plan.token_budget -= num_new_tokens

    # ----------------------------------------------------------------------------------
    # Encoder inputs (media items)
    # ----------------------------------------------------------------------------------
    def _plan_encoder_inputs(self, request: Request, num_computed: int, num_new_tokens: int,
                             plan: _StepPlan) -> tuple[list[int], int]:
        """Which of ``request``'s media items must be encoded for tokens [num_computed,
        num_computed + num_new_tokens), and how many of those tokens can run this step.

        An item is encoded whole, in one step, or not at all. Items already cached (or being
        encoded this step by another request) are referenced. When an item does not fit the
        step's encoder budget or the cache, the chunk stops just before its placeholder (0 tokens
        when the request has already reached into it, e.g. through a prefix-cache hit).
        Cache space for the chosen items is taken by ``_allocate_encoder_inputs`` once the
        request's KV blocks are allocated.
        """
        if self.whole_media_chunks:
            num_new_tokens = self._end_outside_media(request, num_computed, num_new_tokens)
        ecm = self.encoder_cache_manager
        end = num_computed + num_new_tokens
        to_encode: list[int] = []
        identifiers: set[str] = set()
        num_embeds_planned = 0
        for i, feature in enumerate(request.mm_features):
            start, stop = feature.needed_range
            if start >= end:
                break
            if stop <= num_computed:
                continue   # already in the KV cache
            if feature.identifier in identifiers or ecm.check_and_update_cache(request, i):
                continue
            if not ecm.can_allocate(request, i, plan.encoder_budget - num_embeds_planned, num_embeds_planned):
                num_new_tokens = max(0, start - num_computed)
                break
            to_encode.append(i)
            identifiers.add(feature.identifier)
            num_embeds_planned += feature.num_embeds
        return to_encode, num_new_tokens

    def _max_chunk_tokens(self) -> int:
        threshold = self.scheduler_config.long_prefill_token_threshold
        budget = self.scheduler_config.max_num_batched_tokens
        return min(budget, threshold) if threshold > 0 else budget

    @staticmethod
    def _end_outside_media(request: Request, num_computed: int, num_new_tokens: int) -> int:
        """``num_new_tokens`` cut back so that the chunk from ``num_computed`` does not end inside a placeholder
        (0: the chunk would start inside, or at, one that does not fit whole)."""
        end = num_computed + num_new_tokens
        for feature in request.mm_features:
            if feature.placeholder is None:
                continue
            start, stop = feature.placeholder.offset, feature.placeholder.offset + feature.placeholder.length
            if start < end < stop:
                return max(0, start - num_computed)
        return num_new_tokens

    def _allocate_encoder_inputs(self, plan: _StepPlan, request: Request, encoder_inputs: list[int]) -> None:
        if not encoder_inputs:
            return
        for i in encoder_inputs:
            self.encoder_cache_manager.allocate(request, i)
            plan.encoder_budget -= request.mm_features[i].num_embeds
        plan.encoder_inputs[request.request_id] = tuple(encoder_inputs)

    def _release_consumed_encoder_inputs(self, request: Request) -> None:
        """Drop the request's reference to each item whose last placeholder in the request is computed."""
        last_end: dict[str, tuple[int, int]] = {}
        for i, feature in enumerate(request.mm_features):
            last_end[feature.identifier] = (i, feature.needed_range[1])
        for i, end in last_end.values():
            if end <= request.num_computed_tokens:
                self.encoder_cache_manager.free_encoder_input(request, i)

    # ----------------------------------------------------------------------------------
    # LoRA slots and anti-starvation
    # ----------------------------------------------------------------------------------
    def _lora_admissible(self, request: Request) -> bool:
        """Whether a waiting LoRA request may take a slot reference now.

        Anti-starvation rule (reserve-and-drain): after a step's admissions, if no
        reservation exists, the first waiting request in queue order that needed a new slot
        and got none (the oldest such, under fcfs) becomes the *holder* once it has waited
        ``lora_reserve_after_steps`` steps, and one busy slot (the one expected to idle
        soonest) becomes the *drain slot*. While a reservation exists: (a) only the holder
        may bring a new adapter into a slot, and (b) the drain slot takes no new requests.
        So the drain slot only loses requests; each finishes within its max_tokens, the slot
        idles, and the holder takes it (or any slot that idles first) at its next turn, along
        with every waiting request of its adapter. The next holder is again the oldest
        slotless request, so under fcfs a request waits about (distinct adapters queued
        ahead of it + 1) x (grace + one drain), plus any wait for KV blocks or budget.
        Requests of other resident adapters and base-model requests keep flowing meanwhile.
        Under the priority policy the bound holds among requests of equal or better rank.
        """
        assert self.lora_slots is not None and request.lora_request is not None
        reservation = self._lora_reservation
        is_holder = reservation is not None and reservation.req_id == request.request_id
        slot = self.lora_slots.slot_of(request.lora_request.lora_name)
        if slot is not None:
            return reservation is None or is_holder or slot != reservation.drain_slot
        if not self._lora_host_ready(request.lora_request):
            return False   # its adapter is being read from disk: the others go on
        if (reservation is None or is_holder) and self.lora_slots.can_acquire(
                request.lora_request, self._lora_rank_of(request.lora_request)):
            return True
        self._lora_blocked_since.setdefault(request.request_id, self.num_steps)
        return False

    def lora_demand(self) -> dict[str, int]:
        """Adapter name -> queue position of the first waiting request that names it: what slot and
        host-store eviction keep longest (an adapter waited for soonest is evicted last)."""
        demand: dict[str, int] = {}
        for position, request in enumerate(self.waiting):
            if request.lora_request is not None:
                demand.setdefault(request.lora_request.lora_name, position)
        return demand

    def _prefetch_lora_slots(self, plan: _StepPlan) -> None:
        """Slot loads for the waiting requests the scheduler will admit next: the first ``max_loras``
        waiting requests (queue order) whose adapter has no slot are looked at; an adapter in host
        memory (``lora_ready``, which has a missing one read from disk off the step loop) goes to an
        empty slot or one whose idle adapter nobody waits for (``LoRASlotManager.prefetch``), so its
        copy (``LoRASlotLoad.prefetch``: on a side stream on CUDA) runs beside this step and the step
        that admits the request loads nothing. Not while a slot is reserved (the holder goes first), and
        only in a step that runs tokens (the runner's ``set_batch`` of this step then hands the copy's
        wait to the next step: ``LoRAManager.load_slots``)."""
        slots = self.lora_slots
        if (slots is None or self._lora_reservation is not None or len(self.waiting) == 0
                or not plan.num_scheduled_tokens):
            return
        demand: Optional[dict[str, int]] = None
        looked = 0
        for request in self.waiting:
            lora_request = request.lora_request
            if lora_request is None or slots.slot_of(lora_request.lora_name) is not None:
                continue
            looked += 1
            if looked > slots.max_loras:
                break
            if not self._lora_host_ready(lora_request):
                continue
            demand = self.lora_demand() if demand is None else demand
            grant = slots.prefetch(lora_request, demand, self._lora_rank_of(lora_request))
            if grant is None:
                break                       # every free slot's adapter is waited for
            self._check_slot_load(grant, lora_request.lora_name)
            plan.lora_loads.append(LoRASlotLoad(grant.lora_slot, lora_request, prefetch=True, pages=grant.pages))

    def _lora_rank_of(self, lora_request: LoRARequest) -> int:
        """The adapter's rank for the slot pool (0 without ``lora_rank``: padded slots ignore it)."""
        return 0 if self.lora_rank is None else self.lora_rank(lora_request)

    def _lora_host_ready(self, lora_request: LoRARequest) -> bool:
        """``lora_ready``, asked at most once per adapter per step while it says False."""
        name = lora_request.lora_name
        if self.lora_ready is None:
            return True
        if name in self._lora_not_ready:
            return False
        if self.lora_ready(lora_request):
            return True
        self._lora_not_ready.add(name)
        return False

    def _check_slot_load(self, grant: SlotGrant, loaded: str) -> None:
        """Count a slot load that evicts or reloads an adapter a running request uses
        (``num_lora_reloads_while_running``); checked against ``running`` itself, not the slot counts."""
        evicted = grant.evicted
        touched = {loaded, evicted, *grant.evicted_more}
        for r in self.running:
            if r.lora_request is not None and r.lora_request.lora_name in touched:
                self.num_lora_reloads_while_running += 1
                logger.error("LoRA slot load of %r (evicting %r) while request %s runs on it", loaded, evicted,
                             r.request_id)
                return

    def _needs_new_slot(self, request: Request) -> bool:
        assert self.lora_slots is not None and request.lora_request is not None
        return self.lora_slots.slot_of(request.lora_request.lora_name) is None

    def _maybe_reserve_lora_slot(self, oldest_slotless: Request) -> None:
        """Make ``oldest_slotless`` the reservation holder if due (see ``_lora_admissible``)."""
        assert self.lora_slots is not None and oldest_slotless.lora_request is not None
        if self._lora_reservation is not None or not self._needs_new_slot(oldest_slotless):
            return
        lora_request = oldest_slotless.lora_request
        if self.lora_slots.can_acquire(lora_request, self._lora_rank_of(lora_request)):
            return  # a slot idles now: it gets it next step, as the oldest in line
        blocked_since = self._lora_blocked_since.get(oldest_slotless.request_id, self.num_steps)
        if self.num_steps - blocked_since < self.lora_reserve_after_steps:
            return
        # Drain the slot expected to idle soonest: fewest decode steps left among its requests.
        steps_left: dict[int, int] = {}
        for r in self.running:
            if r.lora_request is not None:
                slot = self.lora_slots.slot_of(r.lora_request.lora_name)
                assert slot is not None
                steps_left[slot] = max(steps_left.get(slot, 0), r.max_tokens - r.num_output_tokens)
        drain_slot = self.lora_slots.pick_drain_slot(steps_left)
        assert drain_slot is not None, "no slot can be acquired, so every slot is busy"
        self._lora_reservation = _LoRAReservation(oldest_slotless.request_id, drain_slot)

    def _validate_lora_reservation(self) -> None:
        """Drop the reservation when its holder is no longer waiting (aborted)."""
        res = self._lora_reservation
        if res is None:
            return
        holder = self.requests.get(res.req_id)
        if holder is None or holder.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self._lora_reservation = None

    def _lora_slot(self, request: Request) -> int:
        if request.lora_request is None or self.lora_slots is None:
            return NO_LORA
        slot = self.lora_slots.slot_of(request.lora_request.lora_name)
        assert slot is not None, f"{request} runs without a resident adapter"
        return slot

    def remove_lora(self, lora_name: str) -> bool:
        """Unload an adapter once no unfinished request uses it.

        Returns:
            False while requests (running or waiting) still use it (the engine retries each
            step); True once its slot, if any, is freed.
        """
        for request in self.requests.values():
            if request.lora_request is not None and request.lora_request.lora_name == lora_name:
                return False
        if self.lora_slots is not None:
            self.lora_slots.remove(lora_name)
        return True

    # ----------------------------------------------------------------------------------
    # Output
    # ----------------------------------------------------------------------------------
    def _build_output(self, plan: _StepPlan, structured_output_req_ids: frozenset[str]) -> SchedulerOutput:
        """The step's frozen message. NOTE: ``plan``'s dicts become its read-only mappings without a copy
        (the plan is dropped after this step)."""
        kv = self.kv_cache_manager
        new_reqs = tuple([
            NewRequestData(
                req_id=r.request_id,
                all_token_ids=tuple(r.all_token_ids),
                num_prompt_tokens=r.num_prompt_tokens,
                sampling_params=r.sampling_params,
                block_ids=tuple(kv.get_block_ids(r.request_id)),
                group_block_ids=tuple([tuple(kv.get_block_ids(r.request_id, g)) for g in range(1, kv.num_groups)]),
                cross_block_ids=tuple(kv.get_cross_block_ids(r.request_id)),
                num_computed_tokens=r.num_computed_tokens,
                lora_slot=self._lora_slot(r),
                mm_features=tuple(r.mm_features),
                eos_token_ids=frozenset(r.eos_token_ids),
            ) for r in plan.new_reqs
        ])
        running = plan.running_reqs
        running_slots = tuple([self._lora_slot(r) for r in running])
        if self.lora_slots is not None:
            step_slots = {s for s in running_slots if s >= 0}.union(
                [r.lora_slot for r in new_reqs if r.lora_slot >= 0])
            self.num_lora_step_rank_rows += sum(self.lora_slots.rank_of(s) for s in step_slots)
        cached = CachedRequestData(
            req_ids=tuple([r.request_id for r in running]),
            new_block_ids=tuple([tuple(plan.new_block_ids[r.request_id]) for r in running]),
            num_computed_tokens=tuple([r.num_computed_tokens for r in running]),
            lora_slots=running_slots,
            new_group_block_ids=(tuple([tuple([tuple(ids) for ids in group_lists(plan.new_block_ids[r.request_id])[1:]])
                                        for r in running]) if kv.num_groups > 1 else ()),
        )
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            finished_req_ids=frozenset(self.finished_req_ids),
            preempted_req_ids=frozenset([r.request_id for r in plan.preempted]),
            lora_loads=tuple(plan.lora_loads),
            scheduled_encoder_inputs=plan.encoder_inputs,
            free_encoder_identifiers=tuple(self.encoder_cache_manager.take_freed()),
            structured_output_req_ids=structured_output_req_ids,
        )

    # ----------------------------------------------------------------------------------
    # update_from_output()
    # ----------------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stops (a constrained request's grammar too), free finished requests,
        emit outputs. A constrained request whose grammar rejects its token ends without an output
        (``take_failed``)."""
        row_of = {rid: i for i, rid in enumerate(runner_output.req_ids)}
        outputs: list[EngineCoreOutput] = []
        now = time.time()
        any_finished = False
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # aborted after it was scheduled
            row = row_of.get(req_id)
            sampled = runner_output.sampled_token_ids[row] if row is not None else []
            if sampled:
                request.num_output_placeholders = max(0, request.num_output_placeholders - len(sampled))
            was_running = request.status == RequestStatus.RUNNING
            new_token_ids = self._append_and_check_stop(request, sampled)
            if new_token_ids and self.structured_output is not None:
                self._accept_grammar_tokens(request, new_token_ids)
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if new_token_ids and request.first_token_time is None:
                request.first_token_time = now
            finished = request.is_finished()
            if finished:
                any_finished = True
                if not was_running:
                    # Async scheduling: preempted after this step was launched, finished by its token.
                    self.waiting.remove_requests([request])
                self._free_request(request, held_slot=was_running)
            if request.status == RequestStatus.FINISHED_ERROR:
                continue   # its grammar rejected the token: reported by take_failed()
            if new_token_ids or prompt_logprobs is not None or finished:
                outputs.append(EngineCoreOutput(
                    req_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=runner_output.logprobs.get(req_id) if new_token_ids else None,
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=request.get_finish_reason(),
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                ))
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished()]
        return outputs

    def _accept_grammar_tokens(self, request: Request, token_ids: list[int]) -> None:
        """Feed a constrained request's matcher its new tokens: a grammar that ended finishes the request
        (``stop``, even under ``min_tokens`` or with ``ignore_eos``: nothing else may follow); a token it
        rejects ends the request with an error."""
        rid = request.request_id
        if not self.structured_output.is_constrained(rid):
            return
        status = self.structured_output.accept_tokens(rid, token_ids)
        if status is AcceptStatus.REJECTED:
            request.status = RequestStatus.FINISHED_ERROR
            self._failed[rid] = StructuredOutputError(
                f"the model sampled token {token_ids[-1]}, which the grammar does not allow there; the "
                "request was ended.", param=request.sampling_params.structured_outputs.param).named()
        elif status is AcceptStatus.TERMINATED and not request.is_finished():
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None

    def _append_and_check_stop(self, request: Request, sampled: list[int]) -> list[int]:
        new_token_ids: list[int] = []
        for token_id in sampled:
            request.append_output_token_ids([token_id])
            new_token_ids.append(token_id)
            if self._check_stop(request, token_id):
                break
        return new_token_ids

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """EOS, then stop_token_ids (both only once min_tokens exist), then length."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = None
                return True
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    # ----------------------------------------------------------------------------------
    # Finishing from outside, freeing
    # ----------------------------------------------------------------------------------
    def finish_requests(self, req_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string). Unknown ids are ignored.

        Their ids go into the next ``finished_req_ids``; the engine emits the final output.
        """
        assert RequestStatus.is_finished(finished_status), finished_status
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        from_waiting: list[Request] = []
        from_running = False
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            held_slot = request.status == RequestStatus.RUNNING
            if held_slot:
                from_running = True
            else:
                from_waiting.append(request)
            request.status = finished_status
            self._free_request(request, held_slot)
        if from_running:
            self.running = [r for r in self.running if not r.is_finished()]
        if from_waiting:
            self.waiting.remove_requests(from_waiting)

    def fail_requests(self, req_ids: Iterable[str], stale_loras: Iterable[str] = ()) -> None:
        """Finish requests whose step failed (finish reason 'error'). Unknown ids are ignored.

        NOTE: the failed step may not have written their KV or encoder outputs (or ran them without
        their adapter), so their blocks leave the prefix cache and unreferenced encoder entries are
        evicted instead of being shared later; ``stale_loras`` (adapters whose slot load the step
        held) leave their slots, so the next request naming one loads it again.
        """
        req_ids = list(req_ids)
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is not None:
                self.kv_cache_manager.uncache(request)
        self.finish_requests(req_ids, RequestStatus.FINISHED_ERROR)
        self.encoder_cache_manager.evict_unreferenced()
        if self.lora_slots is not None:
            for lora_name in stale_loras:
                self.lora_slots.remove(lora_name)

    def _free_request(self, request: Request, held_slot: bool) -> None:
        """Release KV blocks, encoder-cache references and the adapter slot reference; forget the request."""
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        if held_slot and request.lora_request is not None:
            assert self.lora_slots is not None
            self.lora_slots.release(request.lora_request)
        request.finished_time = time.time()
        self._lora_blocked_since.pop(request.request_id, None)
        if self.structured_output is not None:
            self.structured_output.free(request.request_id)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def take_failed(self) -> dict[str, BaseException]:
        """Requests ended with an error since the last call, request id -> ``StructuredOutputError`` (a
        grammar that did not compile, or rejected a sampled token): the client reports it (a 400)."""
        failed, self._failed = self._failed, {}
        return failed

    def grammar_bitmask(self, sample_req_ids: Sequence[str]) -> Optional["GrammarBitmask"]:
        """The host bitmask of a step's sampling rows (``sample_req_ids``: the step's requests that sample,
        in logits-row order), filled from the constrained requests' matchers; None when none is
        constrained. Their tokens of every earlier step must have been through ``update_from_output``."""
        if self.structured_output is None:
            return None
        return self.structured_output.fill_bitmask([(rid, row) for row, rid in enumerate(sample_req_ids)])

    # ----------------------------------------------------------------------------------
    # Queries
    # ----------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return len(self.requests) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing done) while blocks are in use."""
        return self.kv_cache_manager.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        ecm = self.encoder_cache_manager
        slots = self.lora_slots
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_steps=self.num_steps,
            max_reqs_per_step=self.max_reqs_per_step,
            num_scheduled_tokens=self.last_num_scheduled_tokens,
            num_active_loras=self.lora_slots.num_resident if self.lora_slots is not None else 0,
            encoder_cache_usage=self.encoder_cache_manager.usage,
            encoder_cache_queries=self.encoder_cache_manager.num_queries,
            encoder_cache_hits=self.encoder_cache_manager.num_hits,
            num_kv_blocks_in_use=kv.num_usable_blocks - kv.num_free_blocks,
            num_kv_blocks=kv.num_usable_blocks,
            num_lora_slots_in_use=(sum(slots.num_running(s) > 0 for s in range(slots.max_loras))
                                   if slots is not None else 0),
            num_lora_slots=slots.max_loras if slots is not None else 0,
            num_lora_slot_loads=slots.num_loads if slots is not None else 0,
            num_lora_slot_evictions=slots.num_evictions if slots is not None else 0,
            num_lora_slot_prefetches=slots.num_prefetches if slots is not None else 0,
            num_lora_reloads_while_running=self.num_lora_reloads_while_running,
            num_lora_step_rank_rows=self.num_lora_step_rank_rows,
            num_encoder_cache_entries=len(ecm.cached),
            num_encoder_cache_entries_in_use=len(ecm.cached) - len(ecm.freeable),
            num_encoder_cache_embeds_in_use=ecm.cache_size - ecm.num_freeable_slots,
            encoder_cache_size=ecm.cache_size,
        )
