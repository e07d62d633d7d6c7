"""Host-memory store of loaded adapters: ``max_cpu_loras`` entries, evicted by recency and pending demand.

The store holds the only host copy of each adapter's tensors (page-locked on CUDA so slot loads
are non-blocking copies). Putting an adapter beyond capacity evicts by recency and pending demand:
first the least recently used adapter no waiting request names, then, when every held adapter is
waited for, the one whose first waiting request is latest in the queue (``demand``), so an adapter
about to be admitted is never dropped for one needed later. The manager reloads an evicted adapter
from disk (off the step loop) when a slot needs it again. ``remove`` drops the
entry, so nothing here keeps the tensors alive afterwards.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping, Optional

from lora.peft_adapter import LoRAAdapter


class AdapterStore:
    """``LoRAAdapter``s by name, kept in recency order.

    Args:
        capacity: adapters kept at once (``max_cpu_loras``).
        pin_memory: pin each adapter's tensors when it is put (CUDA engines).
    """

    def __init__(self, capacity: int, pin_memory: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"max_cpu_loras={capacity} must be >= 1.")
        self.capacity = capacity
        self.pin_memory = pin_memory
        self._adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # oldest first
        self.num_loads = 0
        """Adapters put since start (a reload after eviction counts again)."""
        self.num_evictions = 0

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def names(self) -> list[str]:
        """Adapter names, least recently used first."""
        return list(self._adapters)

    def rank_of(self, name: str) -> Optional[int]:
        """The held adapter's rank (its recency unchanged), or None if not held."""
        adapter = self._adapters.get(name)
        return None if adapter is None else adapter.rank

    def get(self, name: str) -> Optional[LoRAAdapter]:
        """The adapter (marked most recently used), or None if not held."""
        adapter = self._adapters.get(name)
        if adapter is not None:
            self._adapters.move_to_end(name)
        return adapter

    def put(self, adapter: LoRAAdapter, demand: Optional[Mapping[str, int]] = None) -> list[str]:
        """Hold ``adapter`` (replacing one of the same name); returns the names evicted for room.

        Args:
            demand: adapter name -> queue position of its first waiting request (``Scheduler.lora_demand``);
                None: plain LRU. Eviction takes the least recently used adapter not in ``demand``,
                else the one with the latest position (possibly ``adapter`` itself).
        """
        if self.pin_memory and not adapter.is_pinned():   # the loader thread pins what it reads
            adapter.pin_memory()
        self._adapters.pop(adapter.name, None)
        self._adapters[adapter.name] = adapter
        self.num_loads += 1
        evicted = []
        while len(self._adapters) > self.capacity:
            name = self._victim(demand or {})
            del self._adapters[name]
            evicted.append(name)
            self.num_evictions += 1
        return evicted

    def _victim(self, demand: Mapping[str, int]) -> str:
        """The adapter to drop: the least recently used one nobody waits for, else the one waited for latest."""
        for name in self._adapters:          # oldest first
            if name not in demand:
                return name
        return max(self._adapters, key=lambda name: demand[name])

    def remove(self, name: str) -> bool:
        """Drop an adapter; returns whether it was held."""
        return self._adapters.pop(name, None) is not None

    def nbytes(self) -> int:
        """Host bytes of every held adapter's tensors."""
        return sum(a.nbytes() for a in self._adapters.values())
