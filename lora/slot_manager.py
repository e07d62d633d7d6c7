"""Scheduler-side LoRA slot bookkeeping: which adapter sits in which GPU slot.

Ints and names only; the runner copies weights when the ``SchedulerOutput`` says so
(``LoRASlotLoad``). A slot holding an adapter that no running request uses is *idle*: it keeps
its weights (a later request reuses them without a load) but may be evicted when another adapter
needs a slot: first the idle slots whose adapter no waiting request names, least recently used
first, then those whose waiting requests come latest in the queue (``demand``). A slot with running
requests is never evicted. ``prefetch`` places the adapter of a request the scheduler will admit next
in an empty slot or one nobody waits for, so that its copy runs before the step that admits it.

With a ``lora.rank_pool.RankPagePool`` a slot is a page-table entry and the adapter's weights take
``cdiv(rank, PAGE_ROWS)`` pages of the pool: a new adapter needs a free entry and enough free pages, and
as many idle adapters are evicted (in the order above) as that takes; one that cannot fit even then
waits, as for a full slot table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from lora.rank_pool import RankPagePool
from lora.request import LoRARequest


@dataclass(frozen=True)
class SlotGrant:
    """Result of ``LoRASlotManager.acquire``."""

    lora_slot: int
    """GPU slot the request's adapter sits in, 0..max_loras-1."""
    load_needed: bool
    """True when the adapter was not resident: the runner must copy it in before the step."""
    evicted: Optional[str] = field(default=None, compare=False)
    """The idle adapter whose slot this load takes (None: the slot was empty or no load)."""
    pages: tuple[int, ...] = field(default=(), compare=False)
    """With a pool: the pool pages the adapter's weights sit in (the slot's page table); else empty."""
    evicted_more: tuple[str, ...] = field(default=(), compare=False)
    """With a pool: further idle adapters evicted to free their pages (besides ``evicted``)."""


NO_DEMAND: Mapping[str, int] = {}
"""``demand`` of a caller that knows of no waiting request."""


class LoRASlotManager:
    """Adapter -> slot map with per-slot running counts; idle slots evicted by recency and pending demand.

    Args:
        max_loras: number of GPU slots (page-table entries with a pool).
        pool: the pool of rank rows the adapters' weights share (None: each slot holds max_lora_rank rows
            of its own, and ranks are not counted).
    """

    def __init__(self, max_loras: int, pool: Optional[RankPagePool] = None) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras={max_loras} must be >= 1.")
        self.max_loras = max_loras
        self.pool = pool
        self._slot_lora: list[Optional[LoRARequest]] = [None] * max_loras
        self._slot_pages: list[tuple[int, ...]] = [()] * max_loras
        """Pool pages each slot's adapter holds (empty without a pool)."""
        self._slot_rank: list[int] = [0] * max_loras
        """Rank of each slot's adapter as the caller gave it (0: empty, or not given)."""
        self._name_to_slot: dict[str, int] = {}
        # Running requests holding each slot.
        self._num_running = [0] * max_loras
        # Logical time of each slot's last acquire/release (LRU order among idle slots).
        self._last_used = [0] * max_loras
        self._clock = 0
        # Adapters asked to be removed while still in use: freed on their last release.
        self._pending_removal: set[str] = set()
        self.num_loads = 0
        """Adapters put into a slot since start (``acquire`` and ``prefetch``; a swap back counts again)."""
        self.num_evictions = 0
        """Of those, loads that took the slot of another (idle) adapter."""
        self.num_prefetches = 0
        """Of those, ``prefetch`` loads (for a request admitted in a later step)."""

    # --- queries ------------------------------------------------------------------------
    def slot_of(self, lora_name: str) -> Optional[int]:
        """Slot of a resident adapter, or None."""
        return self._name_to_slot.get(lora_name)

    def num_running(self, lora_slot: int) -> int:
        return self._num_running[lora_slot]

    def lora_in_slot(self, lora_slot: int) -> Optional[LoRARequest]:
        return self._slot_lora[lora_slot]

    @property
    def num_resident(self) -> int:
        return len(self._name_to_slot)

    def resident_loras(self) -> dict[str, int]:
        """lora_name -> slot of every resident adapter."""
        return dict(self._name_to_slot)

    def rank_of(self, lora_slot: int) -> int:
        """Rank of the adapter in ``lora_slot`` as ``acquire`` / ``prefetch`` were told (0: empty)."""
        return self._slot_rank[lora_slot]

    def pages_of(self, lora_slot: int) -> tuple[int, ...]:
        """Pool pages of the adapter in ``lora_slot`` (empty: no pool, or an empty slot)."""
        return self._slot_pages[lora_slot]

    def _slot_for_new_adapter(self, demand: Mapping[str, int] = NO_DEMAND, unwanted_only: bool = False,
                              rank: int = 0) -> Optional[tuple[int, list[int]]]:
        """(slot, idle slots to evict first) for a new adapter of ``rank``, or None.

        Without a pool: an empty slot (lowest first), else an idle slot: one whose adapter no waiting
        request names (least recently used first), then one whose first waiting request is latest in the
        queue (``demand``: adapter name -> queue position of its first waiting request). With a pool, idle
        adapters are evicted in that order until a slot and ``rank``'s pages are free; None (nothing
        evicted) when even every idle one would not do. ``unwanted_only``: never evict an adapter waited for.
        """
        empty = [slot for slot, lora in enumerate(self._slot_lora) if lora is None]
        need = 0 if self.pool is None else self.pool.pages_for(rank)
        free_pages = 0 if self.pool is None else self.pool.num_free
        if empty and free_pages >= need:
            return empty[0], []
        idle = [s for s in range(self.max_loras) if self._slot_lora[s] is not None and self._num_running[s] == 0]
        if unwanted_only:
            idle = [s for s in idle if self._slot_lora[s].lora_name not in demand]

        def eviction_order(s: int) -> tuple[int, int, int]:
            position = demand.get(self._slot_lora[s].lora_name)
            return (0, 0, self._last_used[s]) if position is None else (1, -position, self._last_used[s])
        victims: list[int] = []
        for s in sorted(idle, key=eviction_order):
            if (empty or victims) and free_pages >= need:
                break
            victims.append(s)
            free_pages += len(self._slot_pages[s])
        if not (empty or victims) or free_pages < need:
            return None
        return (empty[0] if empty else victims[0]), victims

    def can_acquire(self, lora_request: LoRARequest, rank: int = 0) -> bool:
        """Whether ``acquire`` would succeed now (changes nothing); ``rank``: the adapter's (with a pool)."""
        return (lora_request.lora_name in self._name_to_slot
                or self._slot_for_new_adapter(rank=rank) is not None)

    def pick_drain_slot(self, drain_cost: Optional[dict[int, int]] = None) -> Optional[int]:
        """The busy slot cheapest to drain: lowest ``drain_cost[slot]`` (e.g. steps until its
        requests finish; 0 if absent), then fewest running requests, then least recently used.
        """
        cost = drain_cost or {}
        busy = [s for s in range(self.max_loras) if self._num_running[s] > 0]
        if not busy:
            return None
        return min(busy, key=lambda s: (cost.get(s, 0), self._num_running[s], self._last_used[s]))

    # --- changes ------------------------------------------------------------------------
    def _touch(self, slot: int) -> None:
        self._clock += 1
        self._last_used[slot] = self._clock

    def acquire(self, lora_request: LoRARequest, demand: Mapping[str, int] = NO_DEMAND,
                rank: int = 0) -> Optional[SlotGrant]:
        """Take a slot reference for one running request of ``lora_request``.

        Reuses the adapter's slot when resident; otherwise takes an empty slot or evicts an idle one
        (``_slot_for_new_adapter``: by recency and ``demand``, adapter name -> queue position of its
        first waiting request). ``rank``: the adapter's, which sets its pages with a pool.

        Returns:
            The slot and whether the adapter must be loaded into it, or None if every slot
            holds another adapter with running requests.
        """
        name = lora_request.lora_name
        slot = self._name_to_slot.get(name)
        evicted: tuple[str, ...] = ()
        load_needed = slot is None
        if slot is None:
            plan = self._slot_for_new_adapter(demand, rank=rank)
            if plan is None:
                return None
            slot = plan[0]
            evicted = self._place(slot, lora_request, plan[1], rank)
        # A new user of an adapter pending removal cancels the removal.
        self._pending_removal.discard(name)
        self._num_running[slot] += 1
        self._touch(slot)
        return _grant(slot, load_needed, evicted, self._slot_pages[slot])

    def prefetch(self, lora_request: LoRARequest, demand: Mapping[str, int], rank: int = 0) -> Optional[SlotGrant]:
        """Put a waiting request's adapter in a slot ahead of its admission (no running reference):
        an empty slot or an idle one whose adapter no waiting request names (``demand``), never
        one waited for. None when the adapter is resident already or no such slot exists."""
        if lora_request.lora_name in self._name_to_slot:
            return None
        plan = self._slot_for_new_adapter(demand, unwanted_only=True, rank=rank)
        if plan is None:
            return None
        slot = plan[0]
        evicted = self._place(slot, lora_request, plan[1], rank)
        self._touch(slot)
        self.num_prefetches += 1
        return _grant(slot, True, evicted, self._slot_pages[slot])

    def _place(self, slot: int, lora_request: LoRARequest, victims: list[int], rank: int) -> tuple[str, ...]:
        """Evict the idle adapters in ``victims`` and make ``lora_request`` the adapter of ``slot`` (empty
        or one of them), with its pages; returns the adapters evicted."""
        evicted = []
        for victim in victims:
            assert self._num_running[victim] == 0, "a slot with running requests is never evicted"
            evicted.append(self._slot_lora[victim].lora_name)
            self._free_slot(victim)
            self.num_evictions += 1
        assert self._slot_lora[slot] is None
        if self.pool is not None:
            pages = self.pool.allocate(rank)
            assert pages is not None, "checked by _slot_for_new_adapter"
            self._slot_pages[slot] = pages
        self._slot_lora[slot] = lora_request
        self._slot_rank[slot] = rank
        self._name_to_slot[lora_request.lora_name] = slot
        self.num_loads += 1
        return tuple(evicted)

    def release(self, lora_request: LoRARequest) -> None:
        """Drop one running request's reference (finished or preempted)."""
        name = lora_request.lora_name
        slot = self._name_to_slot.get(name)
        assert slot is not None and self._num_running[slot] > 0, f"release of unheld adapter {name!r}"
        self._num_running[slot] -= 1
        self._touch(slot)
        if self._num_running[slot] == 0 and name in self._pending_removal:
            self._free_slot(slot)

    def remove(self, lora_name: str) -> bool:
        """Unload an adapter: its slot is freed now if idle, else when its last user releases.

        Returns:
            Whether the adapter was resident.
        """
        slot = self._name_to_slot.get(lora_name)
        if slot is None:
            return False
        if self._num_running[slot] == 0:
            self._free_slot(slot)
        else:
            self._pending_removal.add(lora_name)
        return True

    def _free_slot(self, slot: int) -> None:
        lora = self._slot_lora[slot]
        assert lora is not None and self._num_running[slot] == 0
        del self._name_to_slot[lora.lora_name]
        self._pending_removal.discard(lora.lora_name)
        self._slot_lora[slot] = None
        self._slot_rank[slot] = 0
        if self.pool is not None:
            self.pool.free(self._slot_pages[slot])
        self._slot_pages[slot] = ()


def _grant(slot: int, load_needed: bool, evicted: tuple[str, ...], pages: tuple[int, ...]) -> SlotGrant:
    return SlotGrant(slot, load_needed, evicted[0] if evicted else None, pages, evicted[1:])
