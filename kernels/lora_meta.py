"""Per-step grouping of tokens by LoRA slot, shared by every LoRA shrink/expand of the step.

Built once per step from ``token_lora_slots`` (pure torch, any device). Tokens are stably
sorted by slot so that each active slot owns one contiguous segment of ``sorted_token_ids``;
the kernels walk segments (SGMV), so each adapter's weights are read once per step however
many tokens use it, and a decode row is simply a segment of length one.

Shapes depend only on ``num_tokens`` and ``max_loras`` (CUDA-graph friendly); ``num_active``
and ``no_lora`` are host values, the one host sync of the build unless the caller passes
``num_active``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kernels.utils import check_int, check_tensor

NO_LORA = -1
"""Slot of a token that runs the base model only."""


@dataclass
class LoRAKernelMeta:
    """Token grouping by adapter slot for one step. Index ``a`` below is an *active index*:
    position in ``active_slots``, not a slot id."""

    token_lora_slots: torch.Tensor
    """[num_tokens] int32: GPU slot of each token's adapter, NO_LORA (-1) for base-model tokens."""
    sorted_token_ids: torch.Tensor
    """[num_tokens] int32: token indices stably sorted by slot; base-model tokens placed last."""
    active_slots: torch.Tensor
    """[max_loras] int32: slot ids with >= 1 token, ascending, padded with -1."""
    num_tokens_per_slot: torch.Tensor
    """[max_loras] int32: tokens of active_slots[a] (0 for padding entries)."""
    slot_start: torch.Tensor
    """[max_loras] int32: offset of active_slots[a]'s segment in sorted_token_ids (padding
    entries: the number of LoRA tokens, so the column stays non-decreasing)."""
    num_active: int
    """Host int: number of slots with >= 1 token (valid prefix of active_slots)."""
    no_lora: bool
    """Host bool: no token uses an adapter, so the LoRA kernels return at once."""

    @property
    def num_tokens(self) -> int:
        return self.token_lora_slots.shape[0]

    @property
    def max_loras(self) -> int:
        return self.active_slots.shape[0]


def build_lora_kernel_meta(token_lora_slots: torch.Tensor, max_loras: int,
                           num_active: Optional[int] = None) -> LoRAKernelMeta:
    """Group tokens by adapter slot.

    Args:
        token_lora_slots: [num_tokens] int32 (int64 accepted) slots in [0, max_loras) or NO_LORA.
        max_loras: number of GPU adapter slots (fixes the shapes of the per-slot tensors).
        num_active: the number of distinct slots in use, when the caller knows it (the
            scheduler does; it must be exact); None computes it with one device-to-host copy.

    Returns:
        A ``LoRAKernelMeta`` on token_lora_slots' device.
    """
    check_tensor("token_lora_slots", token_lora_slots, ndim=1, dtypes=(torch.int32, torch.int64))
    check_int("max_loras", max_loras, min_value=1)
    if token_lora_slots.device.type == "cpu" and token_lora_slots.numel() > 0:
        # NOTE: checked on host tensors only; on CUDA it would cost a sync (the runner's invariant).
        lo, hi = int(token_lora_slots.min()), int(token_lora_slots.max())
        if lo < NO_LORA or hi >= max_loras:
            raise ValueError(f"token_lora_slots: values must be in [-1, {max_loras}), got [{lo}, {hi}].")
    slots = token_lora_slots.to(torch.int32).contiguous()                      # [T]
    # Base tokens get key max_loras so the stable sort puts them after every segment.
    key = torch.where(slots < 0, torch.full_like(slots, max_loras), slots).long()  # [T]
    sorted_token_ids = torch.sort(key, stable=True).indices.to(torch.int32)   # [T]
    counts_by_slot = torch.bincount(key, minlength=max_loras + 1)[:max_loras]  # [max_loras]
    active = counts_by_slot > 0                                                 # [max_loras]
    # Stable sort of "inactive" flags: active slot ids first, in ascending order.
    order = torch.sort((~active).to(torch.int8), stable=True).indices          # [max_loras]
    active_sorted = active[order]
    active_slots = torch.where(active_sorted, order, torch.full_like(order, -1)).to(torch.int32)
    num_tokens_per_slot = counts_by_slot[order].to(torch.int32)                # 0 where inactive
    starts_by_slot = torch.cumsum(counts_by_slot, 0) - counts_by_slot          # exclusive prefix sum
    num_lora_tokens = counts_by_slot.sum()
    slot_start = torch.where(active_sorted, starts_by_slot[order], num_lora_tokens).to(torch.int32)
    if num_active is None:
        num_active = int(active.sum().item())
    else:
        check_int("num_active", num_active)
        if num_active > max_loras:
            raise ValueError(f"num_active: {num_active} > max_loras {max_loras}.")
    return LoRAKernelMeta(token_lora_slots=slots, sorted_token_ids=sorted_token_ids,
                          active_slots=active_slots, num_tokens_per_slot=num_tokens_per_slot,
                          slot_start=slot_start, num_active=num_active, no_lora=num_active == 0)
