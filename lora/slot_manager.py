"""Scheduler-side LoRA slot bookkeeping: which adapter sits in which GPU slot.

Ints and names only; the runner copies weights when the ``SchedulerOutput`` says so
(``LoRASlotLoad``). A slot holding an adapter that no running request uses is *idle*: it keeps
its weights (a later request reuses them without a load) but may be evicted, least recently
used first, when another adapter needs a slot. A slot with running requests is never evicted.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from lora.request import LoRARequest


class SlotGrant(NamedTuple):
    """Result of ``LoRASlotManager.acquire``."""

    lora_slot: int
    """GPU slot the request's adapter sits in, 0..max_loras-1."""
    load_needed: bool
    """True when the adapter was not resident: the runner must copy it in before the step."""


class LoRASlotManager:
    """Adapter -> slot map with per-slot running counts and LRU eviction of idle slots.

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

    def _slot_for_new_adapter(self) -> Optional[int]:
        """An empty slot (lowest first), else the least recently used idle slot, else None."""
        for slot, lora in enumerate(self._slot_lora):
            if lora is None:
                return slot
        idle = [s for s in range(self.max_loras) if self._num_running[s] == 0]
        if not idle:
            return None
        return min(idle, key=lambda s: self._last_used[s])

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

    def acquire(self, lora_request: LoRARequest) -> Optional[SlotGrant]:
        """Take a slot reference for one running request of ``lora_request``.

        Reuses the adapter's slot when resident; otherwise takes an empty slot or evicts the
        least recently used idle one.

        Returns:
            The slot and whether the adapter must be loaded into it, or None if every slot
            holds another adapter with running requests.
        """
        name = lora_request.lora_name
        slot = self._name_to_slot.get(name)
        load_needed = False
        if slot is None:
            slot = self._slot_for_new_adapter()
            if slot is None:
                return None
            evicted = self._slot_lora[slot]
            if evicted is not None:
                del self._name_to_slot[evicted.lora_name]
                self._pending_removal.discard(evicted.lora_name)
            self._slot_lora[slot] = lora_request
            self._name_to_slot[name] = slot
            load_needed = True
        # A new user of an adapter pending removal cancels the removal.
        self._pending_removal.discard(name)
        self._num_running[slot] += 1
        self._touch(slot)
        return SlotGrant(slot, load_needed)

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
