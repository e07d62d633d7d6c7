"""The step's LoRA batch: token -> slot grouping, built once per step and read by every layer.

``LoRAManager.set_batch`` builds one ``LoRABatch`` per step; every ``LinearLoRASlots`` holds a
reference to the manager's ``LoRABatchState`` and reads the current batch from it, so the
grouping (a sort of the tokens by slot) is computed once, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from kernels.lora_meta import LoRAKernelMeta, build_lora_kernel_meta


@dataclass
class LoRASegment:
    """The tokens of one active slot (torch path only)."""

    lora_slot: int
    token_ids: Optional[torch.Tensor]
    """[num_slot_tokens] int64 token rows, or None when the slot owns every token of the step."""


@dataclass
class LoRABatch:
    """One step's grouping of tokens by adapter slot."""

    meta: LoRAKernelMeta
    """Sorted token ids, active slots, per-slot counts and starts (what the kernels read)."""
    segments: list[LoRASegment]
    """Host list of (slot, token rows) per active slot; filled for the torch path only."""

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens

    @property
    def no_lora(self) -> bool:
        return self.meta.no_lora


def build_lora_batch(token_lora_slots: torch.Tensor, max_loras: int, with_segments: bool) -> LoRABatch:
    """Group the step's tokens by slot.

    Args:
        token_lora_slots: [num_tokens] int32 slot per token, NO_LORA (-1) for the base model.
        max_loras: number of slots.
        with_segments: also build host segments for the torch path (one device-to-host copy).
    """
    meta = build_lora_kernel_meta(token_lora_slots, max_loras)
    segments: list[LoRASegment] = []
    if with_segments and not meta.no_lora:
        n = meta.num_active
        slots = meta.active_slots[:n].tolist()
        counts = meta.num_tokens_per_slot[:n].tolist()
        starts = meta.slot_start[:n].tolist()
        sorted_ids = meta.sorted_token_ids.long()                                   # [T]
        for slot, count, start in zip(slots, counts, starts):
            rows = None if count == meta.num_tokens else sorted_ids[start:start + count]
            segments.append(LoRASegment(slot, rows))
    return LoRABatch(meta=meta, segments=segments)


@dataclass
class LoRABatchState:
    """Shared by the manager and every LoRA layer: the current step's batch and scratch space."""

    batch: Optional[LoRABatch] = None
    """None before the first step (layers then add nothing)."""
    _shrink_buffer: Optional[torch.Tensor] = field(default=None, repr=False)

    def shrink_buffer(self, num_slices: int, num_tokens: int, rank: int,
                      device: torch.device) -> torch.Tensor:
        """A float32 [num_slices, num_tokens, rank] view of one scratch buffer that only grows.

        NOTE: layers run one after another, so one buffer serves them all.
        """
        buf = self._shrink_buffer
        need = num_slices * num_tokens * rank
        if buf is None or buf.numel() < need or buf.device != device:
            buf = torch.empty(max(need, 2 * (0 if buf is None else buf.numel())),
                              dtype=torch.float32, device=device)                 # [capacity]
            self._shrink_buffer = buf
        return buf[:need].view(num_slices, num_tokens, rank)
