"""Scheduler-side bookkeeping of the encoder cache: which media items' encoder outputs the runner
holds, who references them, and which to evict. Ints and ids only; the runner owns the tensors.

Sizes are in encoder embeddings (rows of encoder output = placeholder tokens of the item), not
in prompt tokens. An entry is keyed by the item's content hash (``MultiModalFeature.identifier``):

- a request references an entry from the step its item is encoded (or found cached) until the
  last placeholder of that identifier in the request is computed, or it finishes, is aborted or
  preempted; an image twice in one prompt is one reference, held to its last occurrence;
- an entry nobody references stays cached (LRU) and is evicted only when space is needed; the
  evicted identifiers go to the runner in the next ``SchedulerOutput`` (``free_encoder_identifiers``),
  which drops their tensors before that step runs.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.request import Request


class EncoderCacheManager:
    """Space and references of the runner's encoder cache.

    Args:
        cache_size: encoder embeddings the cache holds at most.
    """

    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        """Embeddings not held by any entry (referenced or not)."""
        self.num_freeable_slots = cache_size
        """Free embeddings plus those of unreferenced entries (what eviction could make free)."""
        self.cached: dict[str, set[str]] = {}
        """identifier -> ids of the requests referencing it (empty: unreferenced, evictable)."""
        self.sizes: dict[str, int] = {}
        """identifier -> its embeddings."""
        self.freeable: OrderedDict[str, None] = OrderedDict()
        """Unreferenced identifiers, least recently released first."""
        self.freed: list[str] = []
        """Evicted since the last ``take_freed``: the runner drops their tensors."""
        self.num_queries = 0
        """Items looked up (one per item a request reaches), since start."""
        self.num_hits = 0
        """Of those, found cached (encoded earlier or earlier this step)."""

    # ------------------------------------------------------------------ lookups
    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """Whether item ``input_id`` of ``request`` is cached; if so, ``request`` references it."""
        identifier = request.mm_features[input_id].identifier
        self.num_queries += 1
        refs = self.cached.get(identifier)
        if refs is None:
            return False
        self.num_hits += 1
        if not refs:
            del self.freeable[identifier]
            self.num_freeable_slots -= self.sizes[identifier]
        refs.add(request.request_id)
        return True

    def can_allocate(self, request: Request, input_id: int, encoder_compute_budget: int,
                     num_embeds_to_schedule: int) -> bool:
        """Whether item ``input_id`` can be encoded this step: it fits the step's remaining encoder
        budget, and the cache after ``num_embeds_to_schedule`` embeddings already planned this step,
        evicting unreferenced entries (LRU) if needed. Evicts only when the answer is yes."""
        num_embeds = request.mm_features[input_id].num_embeds
        if num_embeds > encoder_compute_budget:
            return False
        num_needed = num_embeds + num_embeds_to_schedule
        if num_needed <= self.num_free_slots:
            return True
        if num_needed > self.num_freeable_slots:
            return False
        while num_needed > self.num_free_slots:
            identifier, _ = self.freeable.popitem(last=False)
            size = self.sizes.pop(identifier)
            del self.cached[identifier]
            self.num_free_slots += size
            self.freed.append(identifier)
        return True

    def allocate(self, request: Request, input_id: int) -> None:
        """Reserve space for item ``input_id`` of ``request`` (encoded this step) and reference it."""
        feature = request.mm_features[input_id]
        num_embeds = feature.num_embeds
        self.cached[feature.identifier] = {request.request_id}
        self.sizes[feature.identifier] = num_embeds
        self.num_free_slots -= num_embeds
        self.num_freeable_slots -= num_embeds

    # ------------------------------------------------------------------ releasing
    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """Drop ``request``'s reference to item ``input_id``; unreferenced entries stay cached."""
        identifier = request.mm_features[input_id].identifier
        refs = self.cached.get(identifier)
        if refs is None or request.request_id not in refs:
            return
        refs.discard(request.request_id)
        if not refs:
            self.freeable[identifier] = None
            self.num_freeable_slots += self.sizes[identifier]

    def free(self, request: Request) -> None:
        """Drop every reference of ``request`` (finish, abort, preemption)."""
        for input_id in range(len(request.mm_features)):
            self.free_encoder_input(request, input_id)

    def take_freed(self) -> list[str]:
        """The identifiers evicted since the last call (for the step's ``SchedulerOutput``)."""
        freed, self.freed = self.freed, []
        return freed

    def evict_unreferenced(self) -> None:
        """Evict every unreferenced entry (the evictions join ``take_freed``)."""
        while self.freeable:
            identifier, _ = self.freeable.popitem(last=False)
            self.num_free_slots += self.sizes.pop(identifier)
            del self.cached[identifier]
            self.freed.append(identifier)

    @property
    def usage(self) -> float:
        """Fraction of the cache held by entries (referenced or not)."""
        return 1.0 - self.num_free_slots / self.cache_size if self.cache_size else 0.0
