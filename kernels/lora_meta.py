"""Per-step grouping of tokens by LoRA slot, shared by every LoRA shrink/expand of the step.

Built once per step from ``token_lora_slots`` (pure torch, any device). Tokens are stably
sorted by slot so that each active slot owns one contiguous segment of ``sorted_token_ids``;
the kernels walk segments (SGMV), so each adapter's weights are read once per step however
many tokens use it, and a decode row is simply a segment of length one.

Shapes depend only on ``num_tokens`` and ``max_loras``. ``num_active`` and ``no_lora`` are host
values that size the launch (the one host sync of the torch build unless the caller passes
``num_active``). With ``fixed_grid`` (CUDA graphs) the launch covers all ``max_loras`` segments
whatever the batch, so one captured graph serves every adapter mix: entries past the real active
count are padding (slot -1, zero tokens) and their programs exit at once.

``group_slots_host`` is the same grouping in numpy, for the runner, which knows every token's slot
on the host: no device work and no sync; ``lora.batch.LoRAMetaBuffers`` copies it into static
device buffers that the kernels (and the captured graphs) read.

``max_split_k`` / ``shrink_buffer_rows`` are the sizing rule of the shrink's split-K partials
buffer, here (no triton import) so that ``lora.batch`` can reserve it before any kernel runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from kernels.utils import check_int, check_tensor

NO_LORA = -1
"""Slot of a token that runs the base model only."""

MAX_SPLIT_K = 16
"""The most input-dim splits of one shrink tile (each stores its own fp32 partial)."""

MAX_PARTIAL_ROWS = 4096
"""split_k * num_tokens stays <= max(num_tokens, this): the partials of a big step stay small."""


def max_split_k(num_tokens: int) -> int:
    """The largest split_k any config uses for num_tokens tokens (a power of two)."""
    cap = min(MAX_SPLIT_K, max(1, MAX_PARTIAL_ROWS // max(num_tokens, 1)))
    return 1 << (cap.bit_length() - 1)


def shrink_buffer_rows(num_tokens: int) -> int:
    """split_k * num_tokens of the largest partials buffer a step of num_tokens tokens uses.

    NOTE: non-decreasing in num_tokens, so a buffer reserved for the largest step fits every step.
    """
    return max(num_tokens, min(num_tokens * MAX_SPLIT_K, MAX_PARTIAL_ROWS))


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
    """Host int: segments the launch covers: the number of slots with >= 1 token (valid prefix
    of active_slots), or max_loras with fixed_grid."""
    no_lora: bool
    """Host bool: no token uses an adapter, so the LoRA kernels return at once (never with fixed_grid)."""
    fixed_grid: bool = False
    """Launch sizes depend only on num_tokens and max_loras, never on the data (CUDA graphs): the
    kernels always launch and find inactive slots and empty segments on the device."""

    @property
    def num_tokens(self) -> int:
        return self.token_lora_slots.shape[0]

    @property
    def max_loras(self) -> int:
        return self.active_slots.shape[0]


def build_lora_kernel_meta(token_lora_slots: torch.Tensor, max_loras: int,
                           num_active: Optional[int] = None, fixed_grid: bool = False) -> LoRAKernelMeta:
    """Group tokens by adapter slot.

    Args:
        token_lora_slots: [num_tokens] int32 (int64 accepted) slots in [0, max_loras) or NO_LORA.
        max_loras: number of GPU adapter slots (fixes the shapes of the per-slot tensors).
        num_active: the number of distinct slots in use, when the caller knows it (the
            scheduler does; it must be exact); None computes it with one device-to-host copy.
        fixed_grid: size launches by max_loras (no host sync; see ``LoRAKernelMeta.fixed_grid``).

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
    if fixed_grid:
        return LoRAKernelMeta(token_lora_slots=slots, sorted_token_ids=sorted_token_ids,
                              active_slots=active_slots, num_tokens_per_slot=num_tokens_per_slot,
                              slot_start=slot_start, num_active=max_loras, no_lora=False, fixed_grid=True)
    if num_active is None:
        num_active = int(active.sum().item())
    else:
        check_int("num_active", num_active)
        if num_active > max_loras:
            raise ValueError(f"num_active: {num_active} > max_loras {max_loras}.")
    return LoRAKernelMeta(token_lora_slots=slots, sorted_token_ids=sorted_token_ids,
                          active_slots=active_slots, num_tokens_per_slot=num_tokens_per_slot,
                          slot_start=slot_start, num_active=num_active, no_lora=num_active == 0)


@dataclass
class HostSlotGrouping:
    """``build_lora_kernel_meta``'s columns computed on the host (numpy int32)."""

    sorted_token_ids: np.ndarray
    """[num_tokens]: token indices stably sorted by slot; base-model tokens last."""
    active_slots: np.ndarray
    """[max_loras]: slots with >= 1 token, ascending, padded with -1."""
    num_tokens_per_slot: np.ndarray
    """[max_loras]: tokens of active_slots[a] (0 for padding)."""
    slot_start: np.ndarray
    """[max_loras]: segment offsets (padding: the number of LoRA tokens)."""
    num_active: int
    """Slots with >= 1 token."""


def group_slots_host(token_lora_slots: np.ndarray, max_loras: int) -> HostSlotGrouping:
    """The grouping of ``build_lora_kernel_meta`` in numpy (same columns, same order).

    Args:
        token_lora_slots: [num_tokens] integer slots in [0, max_loras) or NO_LORA.
        max_loras: number of GPU adapter slots.
    """
    slots = np.asarray(token_lora_slots)
    if slots.ndim != 1 or not np.issubdtype(slots.dtype, np.integer):
        raise ValueError(f"token_lora_slots: expected a 1-d integer array, got {slots.dtype} {slots.shape}.")
    check_int("max_loras", max_loras, min_value=1)
    if slots.size and (slots.min() < NO_LORA or slots.max() >= max_loras):
        raise ValueError(f"token_lora_slots: values must be in [-1, {max_loras}), got "
                         f"[{slots.min()}, {slots.max()}].")
    key = np.where(slots < 0, max_loras, slots)                                   # [T]
    sorted_token_ids = np.argsort(key, kind="stable").astype(np.int32)           # [T]
    counts = np.bincount(key, minlength=max_loras + 1)[:max_loras]               # [max_loras]
    active = np.flatnonzero(counts)                                              # ascending slot ids
    n = active.size
    active_slots = np.full(max_loras, -1, dtype=np.int32)                        # [max_loras]
    active_slots[:n] = active
    num_tokens_per_slot = np.zeros(max_loras, dtype=np.int32)                    # [max_loras]
    num_tokens_per_slot[:n] = counts[active]
    slot_start = np.full(max_loras, counts.sum(), dtype=np.int32)                # [max_loras]
    slot_start[:n] = (np.cumsum(counts) - counts)[active]
    return HostSlotGrouping(sorted_token_ids, active_slots, num_tokens_per_slot, slot_start, int(n))
