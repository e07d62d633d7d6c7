"""Per-layer LoRA slot buffers of a MoE layer's routed experts (``engine.layers.moe.FusedMoE``).

One ``ExpertLoRASlots`` is attached to each adapted ``FusedMoE`` as its ``adapter`` (it implements
``engine.layers.moe.ExpertsAdapter``). Its buffers hold, for ``max_loras`` slots of ``max_rank`` and every
expert, the three projections' A and B (``engine.layers.moe.ExpertLoRAWeights`` gives the layout); the scale
is folded into B, ranks are zero-padded and experts or projections an adapter does not target are zero. The
compute is the MoE layer's (``engine.layers.moe.fused_moe_lora``): the update runs inside the fused MoE path,
grouped per (slot, expert), each token reading its own slot.

Slices, as the manager loads them (``LoRAManager.load_slot``): 0 gate, 1 up, 2 down; each slice's weights
are ``LoRASliceWeights`` with A [E, r, in] and B [E, out, r] (``lora.peft_adapter``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from engine.layers.moe import ExpertLoRAWeights
from lora.batch import LoRABatchState
from lora.peft_adapter import LoRASliceWeights

EXPERT_SLICES = ("gate", "up", "down")
"""The slices of an experts update, in slice-index order."""


class ExpertLoRASlots(nn.Module):
    """Slot buffers of one layer's routed experts.

    Args:
        num_experts: E.
        hidden_size: H (the gate/up input, the down output).
        intermediate_size: I on this rank (the gate/up output, the down input).
        max_loras, max_rank: slots and their rank.
        dtype, device: of the buffers.
        state: the manager's per-step batch holder, shared by every layer.
    """

    num_slices = len(EXPERT_SLICES)
    stacked_weight = None
    """No stacked decode GEMM here (``LinearLoRASlots.stacked_weight``'s role): the update is grouped by expert."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, state: LoRABatchState) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.state = state
        L, E, R, H, I = max_loras, num_experts, max_rank, hidden_size, intermediate_size
        kw = dict(dtype=dtype, device=device)
        self.register_buffer("a13", torch.zeros(L, E, 2 * R, H, **kw), persistent=False)     # [L, E, 2R, H]
        self.register_buffer("b13", torch.zeros(L, E, 2, I, R, **kw), persistent=False)      # [L, E, 2, I, R]
        self.register_buffer("a2", torch.zeros(L, E, R, I, **kw), persistent=False)          # [L, E, R, I]
        self.register_buffer("b2", torch.zeros(L, E, H, R, **kw), persistent=False)          # [L, E, H, R]

    def _views(self, lora_slot: int, slice_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [E, R, in], B [E, out, R]) of one slot's slice, views of the buffers."""
        R = self.max_rank
        if slice_idx == 2:
            return self.a2[lora_slot], self.b2[lora_slot]
        return self.a13[lora_slot, :, slice_idx * R:(slice_idx + 1) * R], self.b13[lora_slot, :, slice_idx]

    def set_slice(self, lora_slot: int, slice_idx: int, weights: Optional[LoRASliceWeights]) -> None:
        """Copy one projection's per-expert A [E, r, in] / B [E, out, r] into a slot, zero-padding the rank;
        None zeroes the slice."""
        a_dst, b_dst = self._views(lora_slot, slice_idx)
        if weights is None:
            a_dst.zero_()
            b_dst.zero_()
            return
        rank = weights.lora_a.shape[1]
        # NOTE: shapes were checked against the base model when the adapter was loaded.
        assert rank <= self.max_rank and weights.lora_a.shape[::2] == a_dst.shape[::2]
        assert weights.lora_b.shape == (*b_dst.shape[:2], rank)
        a_dst[:, :rank].copy_(weights.lora_a, non_blocking=True)
        a_dst[:, rank:].zero_()
        b_dst[:, :, :rank].copy_(weights.lora_b, non_blocking=True)
        b_dst[:, :, rank:].zero_()

    def clear_slot(self, lora_slot: int) -> None:
        for s in range(self.num_slices):
            self.set_slice(lora_slot, s, None)

    def adds_nothing(self) -> bool:
        batch = self.state.batch
        return batch is None or batch.no_lora

    def step_weights(self) -> Optional[ExpertLoRAWeights]:
        """This step's update (``engine.layers.moe.ExpertsAdapter``): the buffers and each token's slot."""
        if self.adds_nothing():
            return None
        return ExpertLoRAWeights(self.state.batch.meta.token_lora_slots, self.a13, self.b13, self.a2, self.b2)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"max_loras={self.max_loras}, max_rank={self.max_rank}")
