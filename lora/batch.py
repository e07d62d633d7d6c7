"""The step's LoRA batch: token -> slot grouping, built once per step and read by every layer.

``LoRAManager.set_batch`` builds one ``LoRABatch`` per step; every ``LinearLoRASlots`` holds a
reference to the manager's ``LoRABatchState`` and reads the current batch from it, so the
grouping (a sort of the tokens by slot) is computed once, not once per layer.

In the engine the grouping is computed on the host (the runner knows every token's slot there)
and copied into ``LoRAMetaBuffers``: static device tensors that every kernel launch, and every
captured decode CUDA graph, reads. ``fill`` rewrites them in place before the step runs (pinned,
non-blocking copies; no host sync, no allocation), so a graph replay sees this step's adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from kernels.lora_meta import LoRAKernelMeta, build_lora_kernel_meta, group_slots_host, shrink_buffer_rows
from kernels.lora_pages import LoRASlotPages


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
    slot_bound: int
    """Every active slot is below this (host int): the slots a stacked GEMM must cover
    (``lora.layers``). A fixed-grid step's is its launch bound, any step may then run."""

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
    return LoRABatch(meta=meta, segments=segments, slot_bound=max_loras)


@dataclass
class LoRABatchState:
    """Shared by the manager and every LoRA layer: the current step's batch and scratch space."""

    batch: Optional[LoRABatch] = None
    """None before the first step (layers then add nothing)."""
    regroup: Optional[Callable[[int], None]] = None
    """Inside an encoder call over media items of different adapters (``LoRAManager.rows_batch`` with
    ``item_rows``): sets ``batch`` for a Linear that sees this many rows (a tower stage with other rows
    per item than the batch's: patches, then merged tokens); None elsewhere."""
    _shrink_buffer: Optional[torch.Tensor] = field(default=None, repr=False)
    """[capacity] float32 scratch that every layer's shrink partials view."""
    _reserved: bool = field(default=False, repr=False)
    """``reserve`` ran: the buffer may be captured by CUDA graphs and is never reallocated."""
    spill: bool = False
    """Inside a ``LoRAManager.rows_batch`` (eager, never captured): a scratch larger than the reserved one
    is allocated for the call instead of raising (the reserved buffer stays where graphs read it)."""
    pages: Optional[LoRASlotPages] = None
    """The slots' page table on the device, which the kernels read: with a pool of rank rows
    (``lora.rank_pool``) static tensors rewritten in place by slot loads; padded slots: the padded
    layout's fixed table (``kernels.lora_pages.padded_pages``). None: the kernels make the padded one."""
    slot_rows: list[Optional[torch.Tensor]] = field(default_factory=list)
    """With a pool: per slot, [rank_l] int64 pool rows of its adapter on the device (None: empty slot);
    what the torch path and slot loads index the pool buffers with."""

    def reserve(self, num_slices: int, num_tokens: int, rank: int, device: torch.device) -> None:
        """Allocate the scratch buffer for the largest step up front: num_slices x rank x
        ``shrink_buffer_rows(num_tokens)`` floats, enough for the partials of any split_k the
        shrink configs pick for up to num_tokens tokens (they clamp split_k to fit).

        NOTE: CUDA graphs keep the buffer's address; it must never be reallocated after capture,
        so after this call ``shrink_buffer`` raises instead of growing.
        """
        need = num_slices * shrink_buffer_rows(num_tokens) * rank
        buf = self._shrink_buffer
        if buf is None or buf.numel() < need or buf.device != device:
            self._shrink_buffer = torch.empty(need, dtype=torch.float32, device=device)   # [capacity]
        self._reserved = True

    def shrink_buffer(self, num_slices: int, split_k: int, num_tokens: int, rank: int,
                      device: torch.device) -> torch.Tensor:
        """A float32 [num_slices, split_k, num_tokens, rank] view of the one scratch buffer.

        Before ``reserve`` the buffer grows as needed (tests, tools); after it, a request that
        does not fit is a bug (a larger step than reserved for) and raises, except in a rows batch
        (``spill``), which gets a scratch of its own.
        NOTE: layers run one after another, so one buffer serves them all.
        """
        buf = self._shrink_buffer
        need = num_slices * split_k * num_tokens * rank
        if buf is None or buf.numel() < need or buf.device != device:
            if self._reserved and self.spill:
                spilled = torch.empty(need, dtype=torch.float32, device=device)   # [need], this call's alone
                return spilled.view(num_slices, split_k, num_tokens, rank)
            if self._reserved:
                raise RuntimeError(f"LoRA shrink buffer: [{num_slices}, {split_k}, {num_tokens}, {rank}] "
                                   f"does not fit the reserved {0 if buf is None else buf.numel()} floats "
                                   f"on {None if buf is None else buf.device}.")
            buf = torch.empty(max(need, 2 * (0 if buf is None else buf.numel())),
                              dtype=torch.float32, device=device)                 # [capacity]
            self._shrink_buffer = buf
        return buf[:need].view(num_slices, split_k, num_tokens, rank)


class LoRAMetaBuffers:
    """Static device tensors holding one step's ``LoRAKernelMeta``, filled in place from the host.

    Layout: one int32 device tensor ``[3 * max_loras + 2 * max_num_tokens]`` = active_slots |
    num_tokens_per_slot | slot_start | token_lora_slots | sorted_token_ids, with two pinned host
    mirrors used in turn (a mirror is rewritten only after its previous copy has finished).

    Args:
        max_num_tokens: the largest step (the runner's step-buffer size).
        max_loras: GPU adapter slots.
        device: where the kernels run.
    """

    def __init__(self, max_num_tokens: int, max_loras: int, device: torch.device) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_loras = max_loras
        self.device = torch.device(device)
        self._pinned = self.device.type == "cuda"
        size = 3 * max_loras + 2 * max_num_tokens
        self._dev = torch.full((size,), -1, dtype=torch.int32, device=self.device)          # [size]
        self._mirrors = [torch.empty(size, dtype=torch.int32, pin_memory=self._pinned) for _ in range(2)]
        self._copied: list[Optional[torch.cuda.Event]] = [None, None]
        self._turn = 0
        L, M = max_loras, max_num_tokens
        d = self._dev
        self.active_slots = d[0:L]                          # [max_loras]
        self.num_tokens_per_slot = d[L:2 * L]               # [max_loras]
        self.slot_start = d[2 * L:3 * L]                    # [max_loras]
        self.token_lora_slots = d[3 * L:3 * L + M]          # [max_num_tokens]
        self.sorted_token_ids = d[3 * L + M:3 * L + 2 * M]  # [max_num_tokens]

    def fill(self, token_lora_slots: np.ndarray, fixed_grid: bool, with_segments: bool,
             max_active: Optional[int] = None) -> LoRABatch:
        """Group the step's tokens on the host and copy the columns into the device tensors.

        Args:
            token_lora_slots: [num_tokens] host slots (NO_LORA for base-model and padding rows).
            fixed_grid: launches sized by max_loras (the CUDA-graph path; see ``LoRAKernelMeta``).
            with_segments: also build host segments (torch path).
            max_active: with fixed_grid, the launch serves only slots below this (a graph captured
                for few adapters): the launches cover that many segments instead of max_loras
                (the active slots are a prefix of active_slots), and a stacked GEMM that many
                slots. None: max_loras. RuntimeError if the step uses a slot at or above it.

        Returns:
            A ``LoRABatch`` whose meta views these buffers (valid until the next ``fill``).
        """
        T, L, M = len(token_lora_slots), self.max_loras, self.max_num_tokens
        if T > M:
            raise RuntimeError(f"LoRA step of {T} tokens exceeds the meta buffers ({M}).")
        g = group_slots_host(token_lora_slots, L)
        used_bound = int(g.active_slots[:g.num_active].max()) + 1 if g.num_active else 0
        if max_active is not None and (not fixed_grid or used_bound > max_active):
            raise RuntimeError(f"LoRA step using slots below {used_bound} for a launch over slots below "
                               f"{max_active} (fixed_grid={fixed_grid}): the graph choice and the batch disagree.")
        i = self._turn
        self._turn ^= 1
        if self._copied[i] is not None:
            self._copied[i].synchronize()          # its previous copy is done (normally long ago)
        h = self._mirrors[i].numpy()
        h[0:L], h[L:2 * L], h[2 * L:3 * L] = g.active_slots, g.num_tokens_per_slot, g.slot_start
        h[3 * L:3 * L + T] = token_lora_slots
        h[3 * L + M:3 * L + M + T] = g.sorted_token_ids
        nb = self._pinned
        mirror = self._mirrors[i]
        self._dev[:3 * L + T].copy_(mirror[:3 * L + T], non_blocking=nb)
        self._dev[3 * L + M:3 * L + M + T].copy_(mirror[3 * L + M:3 * L + M + T], non_blocking=nb)
        if self._pinned:
            ev = torch.cuda.Event()
            ev.record()
            self._copied[i] = ev
        num_active = (max_active or L) if fixed_grid else g.num_active
        meta = LoRAKernelMeta(token_lora_slots=self.token_lora_slots[:T],
                              sorted_token_ids=self.sorted_token_ids[:T], active_slots=self.active_slots,
                              num_tokens_per_slot=self.num_tokens_per_slot, slot_start=self.slot_start,
                              num_active=num_active, no_lora=not fixed_grid and g.num_active == 0,
                              fixed_grid=fixed_grid)
        segments: list[LoRASegment] = []
        if with_segments:
            for a in range(g.num_active):
                start, count = int(g.slot_start[a]), int(g.num_tokens_per_slot[a])
                rows = None if count == T else torch.from_numpy(
                    g.sorted_token_ids[start:start + count].astype(np.int64)).to(self.device)
                segments.append(LoRASegment(int(g.active_slots[a]), rows))
        return LoRABatch(meta=meta, segments=segments, slot_bound=num_active if fixed_grid else used_bound)
