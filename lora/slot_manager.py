"""Scheduler-side LoRA slot bookkeeping: which adapter sits in which GPU slot.

Ints and names only; the runner copies weights when the ``SchedulerOutput`` says so
(``LoRASlotLoad``). A slot holding an adapter that no running request uses is *idle*: it keeps
its weights (a later request reuses them without a load) but may be evicted when another adapter
needs a slot: first the idle slots whose adapter no waiting request names, least recently used
first, then those whose waiting requests come latest in the queue (``demand``). A slot with running
requests is never evicted. ``prefetch`` places the adapter of a request the scheduler will admit next
in an empty slot or one nobody waits for, so that its copy runs before the step that admits it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

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


NO_DEMAND: Mapping[str, int] = {}
"""``demand`` of a caller that knows of no waiting request."""


class LoRASlotManager:
    """Adapter -> slot map with per-slot running counts; idle slots evicted by recency and pending demand.

    Args:
        max_loras: number of GPU slots.
    """

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras={max_loras} must be >= 1.")
        self.max_loras = max_loras
        self._slot_lora: list[Optional[LoRARequest]] = [None] * max_loras
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

    def _slot_for_new_adapter(self, demand: Mapping[str, int] = NO_DEMAND,
                              unwanted_only: bool = False) -> Optional[int]:
        """An empty slot (lowest first), else an idle slot: one whose adapter no waiting request names
        (least recently used first), then one whose first waiting request is latest in the queue
        (``demand``: adapter name -> queue position of its first waiting request); else None.
        ``unwanted_only``: never a slot whose adapter is waited for."""
        for slot, lora in enumerate(self._slot_lora):
            if lora is None:
                return slot
        idle = [s for s in range(self.max_loras) if self._num_running[s] == 0]
        if unwanted_only:
            idle = [s for s in idle if self._slot_lora[s].lora_name not in demand]
        if not idle:
            return None

        def eviction_order(s: int) -> tuple[int, int, int]:
            position = demand.get(self._slot_lora[s].lora_name)
            return (0, 0, self._last_used[s]) if position is None else (1, -position, self._last_used[s])
        return min(idle, key=eviction_order)

    def can_acquire(self, lora_request: LoRARequest) -> bool:
        """Whether ``acquire`` would succeed now (changes nothing)."""
        return lora_request.lora_name in self._name_to_slot or self._slot_for_new_adapter() is not None

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

    def acquire(self, lora_request: LoRARequest, demand: Mapping[str, int] = NO_DEMAND) -> Optional[SlotGrant]:
        """Take a slot reference for one running request of ``lora_request``.

        Reuses the adapter's slot when resident; otherwise takes an empty slot or evicts an idle one
        (``_slot_for_new_adapter``: by recency and ``demand``, adapter name -> queue position of its
        first waiting request).

        Returns:
            The slot and whether the adapter must be loaded into it, or None if every slot
            holds another adapter with running requests.
        """
        name = lora_request.lora_name
        slot = self._name_to_slot.get(name)
        evicted = None
        load_needed = slot is None
        if slot is None:
            slot = self._slot_for_new_adapter(demand)
            if slot is None:
                return None
            evicted = self._place(slot, lora_request)
        # A new user of an adapter pending removal cancels the removal.
        self._pending_removal.discard(name)
        self._num_running[slot] += 1
        self._touch(slot)
        return SlotGrant(slot, load_needed, evicted)

    def prefetch(self, lora_request: LoRARequest, demand: Mapping[str, int]) -> Optional[SlotGrant]:
        """Put a waiting request's adapter in a slot ahead of its admission (no running reference):
        an empty slot or an idle one whose adapter no waiting request names (``demand``), never
        one waited for. None when the adapter is resident already or no such slot exists."""
        if lora_request.lora_name in self._name_to_slot:
            return None
        slot = self._slot_for_new_adapter(demand, unwanted_only=True)
        if slot is None:
            return None
        evicted = self._place(slot, lora_request)
        self._touch(slot)
        self.num_prefetches += 1
        return SlotGrant(slot, True, evicted)

    def _place(self, slot: int, lora_request: LoRARequest) -> Optional[str]:
        """Make ``lora_request`` the adapter of an empty or idle ``slot``; returns the adapter evicted."""
        assert self._num_running[slot] == 0, "a slot with running requests is never evicted"
        old = self._slot_lora[slot]
        if old is not None:
            del self._name_to_slot[old.lora_name]
            self._pending_removal.discard(old.lora_name)
            self.num_evictions += 1
        self._slot_lora[slot] = lora_request
        self._name_to_slot[lora_request.lora_name] = slot
        self.num_loads += 1
        return None if old is None else old.lora_name

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
