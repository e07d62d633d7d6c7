"""Per-layer LoRA slot buffers and the batched update ``y += (x @ A^T) @ B^T`` per token.

One ``LinearLoRASlots`` is attached to each adapted ``engine.layers.linear.Linear`` as its
``adapter`` (it implements ``engine.layers.adapter.LinearAdapter``). Its buffers are
preallocated for ``max_loras`` slots of ``max_rank``:

- ``lora_a``: [num_slices, max_loras, max_rank, input_size], one A per output slice (q/k/v or
  gate/up each have their own A);
- ``lora_b_{s}``: [max_loras, output_size_s, max_rank] per slice ``s``, with the adapter's scale
  already folded in.

Ranks below ``max_rank`` are zero-padded, and slices an adapter does not target are zero, so
they add nothing. With a pool of rank rows (``num_pages``, ``lora.rank_pool``) the buffers are
instead ``num_pages`` pages of ``PAGE_ROWS`` rank rows that every slot's adapter takes by its own
rank: ``lora_a`` [num_slices, num_pages * PAGE_ROWS, input_size], ``lora_b_{s}`` [num_pages,
output_size_s, PAGE_ROWS], placed through the slots' page table (``LoRABatchState.pages``,
``kernels.lora_pages``); the kernels read only each slot's rank, and the stacked GEMM is not used. Compute goes through the Triton shrink/expand kernels on CUDA and through a
segment-wise torch path elsewhere (one matmul pair per active slot, checked against the kernels'
pure-torch twins in the tests).

The Triton path per call: pick the shrink config (its split_k), take a [num_slices, split_k,
num_tokens, max_rank] view of the shared scratch buffer, shrink into it (per-split partials,
plain stores) and expand from it (summing the partials): two launches, no memset.

Every fast-path choice comes from the engine's ``engine.kernel_policy.KernelPolicy``, given at
construction:

- launch configs: ``lora_shrink`` / ``lora_expand`` override the kernels' defaults;
- overlap (``lora_overlap``): the shrink reads x only, so ``begin(x)`` issues it on a per-device
  side stream before the base GEMM and ``finish`` joins that stream before the expand (``run``
  calls the two around the base ``F.linear``). The fork and the join are ``wait_stream`` calls,
  which CUDA graph capture records as graph edges. On CPU (the Triton interpreter in the tests)
  the same two phases run on the one stream;
- stacked (``lora_stacked_max_tokens``): decode-sized steps compute every slot's shrink inside the
  base GEMM, the slots' A rows stored under the base weight (``stack_onto``, ``begin_stacked``);
- consumer fusions (``lora_fuse_silu_mul`` / ``lora_fuse_rotary`` / ``lora_fuse_norm``): when the
  Linear feeds SiLU-and-mul, the rotary + KV write or the add + RMSNorm (``Feeds``), ``run``
  returns the base output and a ``LoRAPending`` that the consumer completes in one launch with its
  own work (``kernels.lora_expand_silu_mul``, ``kernels.lora_rotary_write_kv``,
  ``kernels.lora_expand_norm``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.kernel_policy import KernelPolicy
from engine.layers.activation import silu_and_mul
from engine.layers.adapter import Feeds
from lora.batch import LoRABatchState
from lora.peft_adapter import LoRASliceWeights
from lora.rank_pool import PAGE_ROWS

if TYPE_CHECKING:
    from kernels.lora_expand import LoRAExpandConfig
    from kernels.lora_shrink import LoRAShrinkConfig

BACKENDS = ("triton", "torch")


@functools.lru_cache(maxsize=None)
def side_stream(device_index: int) -> torch.cuda.Stream:
    """The stream LoRA shrinks overlap the base GEMMs on: one per device, created on first use
    (the engine's warm-up forward, before any CUDA graph capture) and shared by every layer."""
    return torch.cuda.Stream(device=device_index)


@dataclass(frozen=True)
class SplitPlan:
    """One step's launch plan of the split pair (shrink then expand) for one layer."""

    buf: torch.Tensor
    """[num_slices, split_k, num_tokens, max_rank] float32 view of the shared shrink scratch; or,
    with slot_stride, a view of the stacked GEMM's output holding every covered slot's shrink."""
    shrink_cfg: Optional[LoRAShrinkConfig]
    """The shrink's launch config (its split_k is buf.shape[1]); None: the stacked GEMM did it."""
    expand_cfg: LoRAExpandConfig
    """The expand's launch config."""
    slot_stride: int = 0
    """Elements between two slots' h in buf (``kernels.lora_expand.lora_expand``); 0: buf holds
    each token's own partials."""


@dataclass
class LoRAPending:
    """An adapter update that ``LinearLoRASlots.begin`` (or ``begin_stacked``) started and a
    ``finish*`` adds. As an ``engine.pending_update.PendingUpdate``, the consumer of ``y`` completes it."""

    x: torch.Tensor
    """[num_tokens, input_size] the layer input; contiguous when ``plan`` is set. Held until
    ``finish`` so that the tensor the shrink reads outlives it (see ``begin``)."""
    plan: Optional[SplitPlan] = None
    """Set when ``begin`` issued the shrink into ``plan.buf``; None: ``finish`` runs ``forward``."""
    side: Optional[torch.cuda.Stream] = None
    """The side stream the shrink went to, joined by ``finish``; None: the current stream."""
    owner: Optional["LinearLoRASlots"] = None
    """The layer that issued it (its ``finish*`` complete it)."""
    y: Any = None
    """[num_tokens, sum(output_sizes)] the base output the update belongs to (set by ``run``)."""

    def finish(self) -> torch.Tensor:
        return self.owner.finish(self, self.y)

    def finish_silu_mul(self) -> torch.Tensor:
        return self.owner.finish_silu_mul(self, self.y)

    def finish_add_rms_norm(self, weight: torch.Tensor, eps: float, residual: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.owner.finish_add_rms_norm(self, self.y, weight, eps, residual)

    def finish_rotary_write_kv(self, *args: Any, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        self.owner.finish_rotary_write_kv(self, *args, k_scale=k_scale, v_scale=v_scale)


class LinearLoRASlots(nn.Module):
    """Slot buffers of one (possibly packed) Linear and the hook that applies them.

    Args:
        input_size: the Linear's input features.
        output_sizes: its packed output slices (e.g. [q, kv, kv]).
        max_loras: slots.
        max_rank: rank of every slot.
        dtype, device: of the buffers.
        state: the manager's per-step batch holder, shared by every layer.
        backend: "triton" (CUDA kernels) or "torch".
        policy: the engine's kernel policy (None: ``KernelPolicy.for_device(device)``).
        num_pages: pages of the pool of rank rows the slots share (``lora.rank_pool``); None: padded
            slots of max_rank each.
    """

    def __init__(self, input_size: int, output_sizes: list[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, state: LoRABatchState, backend: str,
                 policy: Optional[KernelPolicy] = None, num_pages: Optional[int] = None) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"LoRA backend {backend!r}: use one of {BACKENDS}.")
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.num_slices = len(output_sizes)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.backend = backend
        self.state = state
        offs, acc = [], 0
        for size in self.output_sizes:
            offs.append(acc)
            acc += size
        self.slice_offsets = offs
        policy = policy or KernelPolicy.for_device(device)
        triton = backend == "triton"
        self.shrink_overrides = policy.lora_shrink if triton else ()
        """``LoRAShrinkConfig`` field overrides (``KernelPolicy.lora_shrink``)."""
        self.expand_overrides = policy.lora_expand if triton else ()
        """``LoRAExpandConfig`` field overrides (``KernelPolicy.lora_expand``)."""
        self.overlap = triton and policy.lora_overlap
        """``begin`` issues the split path's shrink before the base GEMM, on ``side_stream`` for CUDA inputs."""
        self.fuse_silu_mul = (self.overlap and self.num_slices == 2 and self.output_sizes[0] == self.output_sizes[1]
                              and policy.lora_fuse_silu_mul)
        """A gate/up-shaped layer (with the overlap) feeding SiLU-and-mul leaves its update to
        ``finish_silu_mul``."""
        self.fuse_rotary = triton and self.num_slices == 3 and policy.lora_fuse_rotary
        """A q/k/v-shaped layer feeding the rotary + KV write leaves its update to
        ``finish_rotary_write_kv`` at decode sizes."""
        self.fuse_norm = triton and self.num_slices == 1 and policy.lora_fuse_norm
        """A one-slice layer feeding the add + RMSNorm (o_proj, down_proj) leaves its update to
        ``finish_add_rms_norm`` where ``kernels.lora_expand_norm.fuses``."""
        self._rotary_max_tokens = 0
        """Steps up to this many tokens defer the q/k/v update (``defers``)."""
        if self.fuse_rotary:
            from kernels.lora_rotary_write_kv import MAX_TOKENS as ROTARY_MAX_TOKENS
            self._rotary_max_tokens = ROTARY_MAX_TOKENS
        self._norm_fuses = None
        """``kernels.lora_expand_norm.fuses`` where ``fuse_norm`` (``defers``)."""
        if self.fuse_norm:
            from kernels.lora_expand_norm import fuses
            self._norm_fuses = fuses
        self.pooled = num_pages is not None
        """Buffers are a pool of rank-row pages (see the module docstring), not padded slots."""
        if self.pooled:
            self.register_buffer("lora_a", torch.zeros(
                self.num_slices, num_pages * PAGE_ROWS, input_size, dtype=dtype, device=device),
                persistent=False)                           # [num_slices, num_pages * PAGE_ROWS, in]
        else:
            self.register_buffer("lora_a", torch.zeros(
                self.num_slices, max_loras, max_rank, input_size, dtype=dtype, device=device),
                persistent=False)                           # [num_slices, max_loras, max_rank, in]
        for s, size in enumerate(self.output_sizes):
            shape = (num_pages, size, PAGE_ROWS) if self.pooled else (max_loras, size, max_rank)
            self.register_buffer(f"lora_b_{s}", torch.zeros(*shape, dtype=dtype, device=device),
                                 persistent=False)          # [num_pages, out_s, PAGE_ROWS] or [max_loras, out_s, max_rank]
        self.stacked_max_tokens = policy.lora_stacked_max_tokens if triton and not self.pooled else 0
        """Steps of at most this many tokens take the stacked GEMM (``begin_stacked``) once
        ``stack_onto`` ran (``KernelPolicy.lora_stacked_max_tokens``; 0: never)."""
        self.stacked_weight: Optional[torch.Tensor] = None  # [out + max_loras * S * R, in] base rows | A rows
        self.stacked_bias: Optional[torch.Tensor] = None    # [out + max_loras * S * R] base bias | zeros
        self._torch_slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Torch path, padded slots: slot -> (A^T [in, S * r], block-diagonal B^T [S * r, sum(out_s)]) in
        float32, r the largest rank of the slot's slices (``_torch_slot``): one GEMM for the shrink of every
        slice and one for the expand. Built on a slot's first use, dropped when it is set."""
        self.stacked_cover: dict[tuple[int, int], int] = {}
        """(num_tokens, slot_bound) -> slots the stacked GEMM covers (>= slot_bound, <= max_loras):
        cuBLAS picks its kernel by shape, and a few more A rows can be faster than the bound's
        (``LoRAManager.tune_stacked_cover`` measures it at start-up); absent: the bound."""

    @property
    def lora_b(self) -> list[torch.Tensor]:
        """Per slice: [max_loras, output_size_s, max_rank] (pooled: [num_pages, output_size_s, PAGE_ROWS])."""
        return [getattr(self, f"lora_b_{s}") for s in range(self.num_slices)]

    # ------------------------------------------------------------------ slots
    def set_slice(self, lora_slot: int, slice_idx: int, weights: Optional[LoRASliceWeights]) -> None:
        """Copy one projection's A/B into a slot, zero-padding the rank (pooled: to the slot's rank, in the
        rows ``state.slot_rows`` names); None zeroes the slice."""
        if self.pooled:
            self._set_pooled_slice(lora_slot, slice_idx, weights)
            return
        self._torch_slots.pop(lora_slot, None)
        a_dst = self.lora_a[slice_idx, lora_slot]                   # [max_rank, in]
        b_dst = self.lora_b[slice_idx][lora_slot]                   # [out_s, max_rank]
        if weights is None:
            a_dst.zero_()
            b_dst.zero_()
            return
        rank = weights.lora_a.shape[0]
        # NOTE: shapes were checked against the base model when the adapter was loaded.
        assert rank <= self.max_rank and weights.lora_a.shape[1] == self.input_size
        assert weights.lora_b.shape == (self.output_sizes[slice_idx], rank)
        a_dst[:rank].copy_(weights.lora_a, non_blocking=True)
        a_dst[rank:].zero_()
        b_dst[:, :rank].copy_(weights.lora_b, non_blocking=True)
        b_dst[:, rank:].zero_()

    def _set_pooled_slice(self, lora_slot: int, slice_idx: int, weights: Optional[LoRASliceWeights]) -> None:
        rows = self.state.slot_rows[lora_slot]                      # [rank_l] pool rows
        pages, sub = rows // PAGE_ROWS, rows % PAGE_ROWS
        a, b = self.lora_a[slice_idx], self.lora_b[slice_idx]      # [pool rows, in], [num_pages, out_s, P]
        rank = 0 if weights is None else weights.lora_a.shape[0]
        # NOTE: shapes were checked against the base model when the adapter was loaded.
        assert rank <= rows.numel() and (weights is None or weights.lora_a.shape[1] == self.input_size)
        if rank:
            a.index_copy_(0, rows[:rank], weights.lora_a.to(a.device, non_blocking=True))
            b[pages[:rank], :, sub[:rank]] = weights.lora_b.t().to(b.device, non_blocking=True)   # [rank, out_s]
        if rank < rows.numel():                                     # the slot reads up to its rank: zeros
            a.index_fill_(0, rows[rank:], 0)
            b[pages[rank:], :, sub[rank:]] = 0

    def clear_slot(self, lora_slot: int) -> None:
        if self.pooled:
            return        # the slot's rank is 0 (``LoRAManager``): nothing reads its pages
        for s in range(self.num_slices):
            self.set_slice(lora_slot, s, None)

    def stack_onto(self, linear: nn.Module) -> None:
        """Put the slots' A rows under ``linear``'s base weight in one tensor (``stacked_weight``):
        rows [0, out) are the base weight, then slot l's slice s's rank r at
        ``out + (l * num_slices + s) * max_rank + r``. ``linear.weight`` (and its bias, zero-padded
        into ``stacked_bias``) and ``lora_a`` become views of it, so a GEMM over its first
        ``out + n * num_slices * max_rank`` rows gives the base output and the shrink of every
        slot below n (``begin_stacked``); nothing is stored twice.

        linear: an ``engine.layers.linear.Linear`` whose weight is [sum(output_sizes), input_size]
        in the slot dtype on the slot device.
        """
        out, S, L, R = sum(self.output_sizes), self.num_slices, self.max_loras, self.max_rank
        w = linear.weight
        if tuple(w.shape) != (out, self.input_size) or w.dtype != self.lora_a.dtype or w.device != self.lora_a.device:
            raise ValueError(f"stack_onto: weight {tuple(w.shape)} {w.dtype} on {w.device} does not match the "
                             f"slots ({out} x {self.input_size}, {self.lora_a.dtype} on {self.lora_a.device}).")
        stacked = torch.empty(out + L * S * R, self.input_size, dtype=w.dtype, device=w.device)
        stacked[:out].copy_(w)
        a_view = stacked[out:].view(L, S, R, self.input_size).permute(1, 0, 2, 3)    # [S, L, R, in]
        a_view.copy_(self.lora_a)
        linear.weight.data = stacked[:out]
        self.lora_a = a_view
        if linear.bias is not None:
            bias = torch.zeros(stacked.shape[0], dtype=linear.bias.dtype, device=w.device)
            bias[:out].copy_(linear.bias)
            linear.bias.data = bias[:out]
            self.stacked_bias = bias
        self.stacked_weight = stacked

    # ------------------------------------------------------------------ compute
    def takes_stacked(self, num_tokens: int) -> bool:
        """A step of num_tokens tokens runs this layer's shrink inside the base GEMM (``begin_stacked``)."""
        return self.stacked_weight is not None and 0 < num_tokens <= self.stacked_max_tokens

    def begin_stacked(self, x: torch.Tensor, weight: torch.Tensor
                      ) -> Optional[tuple[torch.Tensor, LoRAPending]]:
        """(y, pending) from one GEMM over the stacked weight: y is the base output (a view with
        the GEMM's row stride), pending the update still to add (``finish`` / ``finish_silu_mul``
        expand from the GEMM's h columns, each token reading its own slot's). None when this step
        does not take the path (``takes_stacked``; no adapter; ``weight`` is not our stacked base).

        x: [..., input_size]; weight: the Linear's weight, [sum(output_sizes), input_size].
        """
        if self.stacked_weight is None or self.adds_nothing():
            return None
        x2 = self._rows(x)
        num_tokens, batch = x2.shape[0], self.state.batch
        if (not self.takes_stacked(num_tokens) or x2.dtype != weight.dtype or batch.slot_bound < 1
                or weight.data_ptr() != self.stacked_weight.data_ptr()):
            return None
        from kernels.lora_expand import lora_expand_config, slotwise_buf

        out, S, R = sum(self.output_sizes), self.num_slices, self.max_rank
        cover = self.stacked_cover.get((num_tokens, batch.slot_bound), batch.slot_bound)   # slots in the GEMM
        cols = out + cover * S * R
        bias = None if self.stacked_bias is None else self.stacked_bias[:cols]
        y_all = F.linear(x2, self.stacked_weight[:cols], bias)                    # [T, out + cover * S * R]
        buf, slot_stride = slotwise_buf(y_all[:, out:].view(num_tokens, cover, S, R))
        cfg = lora_expand_config(num_tokens, batch.meta.num_active, tuple(self.output_sizes), x2.device,
                                 self.expand_overrides)
        y = y_all[:, :out]                                                         # [T, out] view
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], out)
        return y, LoRAPending(x2, SplitPlan(buf, None, cfg, slot_stride), owner=self)

    def adds_nothing(self) -> bool:
        """True when this step runs no adapter here (``forward`` would return y untouched), so the
        base projection may run fused with its neighbours (``engine.layers.linear``)."""
        batch = self.state.batch
        return batch is None or batch.no_lora

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Add each token's adapter update into y in place.

        x: [num_tokens, input_size]; y: [num_tokens, sum(output_sizes)] (the base output).
        """
        if self.adds_nothing():
            return y
        x2 = self._rows(x)
        batch = self.state.batch                   # after _rows, which may regroup it
        y2 = y.view(-1, y.shape[-1])
        if self.backend == "triton":
            self._forward_triton(x2, y2, batch)
        else:
            self._forward_torch(x2, y2, batch)
        return y

    def begin(self, x: torch.Tensor) -> LoRAPending:
        """First half of ``forward`` for a caller that computes y in between: issue the shrink of
        x now, on ``side_stream`` for CUDA inputs, so it runs alongside the base GEMM. Only on the
        Triton path with ``self.overlap``; otherwise nothing is issued and ``finish`` runs ``forward``.

        x: [num_tokens, input_size]. NOTE: ``finish`` must follow before the forward returns; it
        joins the side stream, without which the adapter update is missing from y and a CUDA graph
        capture fails (a side stream left unjoined).
        """
        if not self.overlap or self.adds_nothing():
            return LoRAPending(x)
        x2 = self._rows(x)
        batch = self.state.batch                   # after _rows, which may regroup it
        # NOTE: the copy (if any), the scratch view and the configs are made on the current stream,
        # before the fork; the side stream only launches the shrink, so it allocates nothing.
        x2 = x2.contiguous()                                                   # [T, in]
        plan = self._plan_split(x2, batch)
        if not x2.is_cuda:
            self._shrink(x2, plan, batch)
            return LoRAPending(x2, plan, owner=self)
        side = side_stream(x2.device.index)
        # NOTE: the fork makes the side stream wait for everything issued so far: x, the step's
        # meta tensors, and the previous layer's expand, which reads the scratch buffer this
        # shrink rewrites. x2 is not record_stream'ed (not allowed during graph capture): it stays
        # alive because the caller holds x and the pending handle holds x2, and once it is freed
        # the allocator can hand its memory only to later work on the current stream, which
        # ``finish`` has made wait for the side stream.
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._shrink(x2, plan, batch)
        return LoRAPending(x2, plan, side, owner=self)

    def finish(self, pending: LoRAPending, y: torch.Tensor) -> torch.Tensor:
        """Second half: join the side stream (if ``begin`` forked) and add the update into y in place.

        y: [num_tokens, sum(output_sizes)] (the base output), computed from the same x.
        """
        if pending.plan is None:
            return self.forward(pending.x, y)
        if pending.side is not None:
            torch.cuda.current_stream().wait_stream(pending.side)
        self._expand(pending.plan, y.view(-1, y.shape[-1]), self.state.batch)
        return y

    def finish_silu_mul(self, pending: LoRAPending, y: torch.Tensor) -> torch.Tensor:
        """SiLU-and-mul of y (gate | up) with the pending adapter update added inside it: one
        ``kernels.lora_expand_silu_mul`` launch for a split plan of this (gate/up-shaped) layer;
        otherwise ``finish`` then ``engine.layers.activation.silu_and_mul``. y is not modified
        on the fused path.

        y: [num_tokens, 2 * d] the base output; returns [num_tokens, d].
        """
        if pending.plan is None or not self.fuse_silu_mul:
            return silu_and_mul(self.finish(pending, y))
        from kernels.lora_expand_silu_mul import lora_expand_silu_mul

        if pending.side is not None:
            torch.cuda.current_stream().wait_stream(pending.side)
        y2 = y.view(-1, y.shape[-1])
        meta = self.state.batch.meta
        return lora_expand_silu_mul(pending.plan.buf, self.lora_b, meta, y2,
                                    config=self._silu_mul_config(y2.shape[0], meta.num_active, y2.device),
                                    slot_stride=pending.plan.slot_stride, pages=self.state.pages)

    def defers(self, num_tokens: int, feeds: Feeds) -> bool:
        """A step of num_tokens tokens leaves this layer's update to the output's consumer
        (``feeds``): gate/up to SiLU-and-mul (``fuse_silu_mul``, any size), o/down to the add +
        RMSNorm (``fuse_norm``) at decode sizes (per-row programs) and at long prefill steps
        (segment tiles; ``kernels.lora_expand_norm.fuses``), q/k/v to the rotary + KV write
        (``fuse_rotary``) at decode sizes."""
        if num_tokens <= 0:
            return False
        if feeds is Feeds.ADD_RMS_NORM:
            return self.fuse_norm and self._norm_fuses(num_tokens)
        if feeds is Feeds.SILU_MUL:
            return self.fuse_silu_mul
        if feeds is Feeds.ROTARY_KV_WRITE:
            return self.fuse_rotary and num_tokens <= self._rotary_max_tokens
        return False

    def run(self, linear: nn.Module, x: torch.Tensor, defer: bool) -> tuple[torch.Tensor, Optional[LoRAPending]]:
        """(y, pending) for the Linear ``linear`` (whose base this layer adapts) on x [num_tokens, in]
        in a step with an adapter update: the base GEMM over the stacked weight, which gives every
        slot's shrink too (decode-sized steps, ``begin_stacked``), or the plain one with the shrink
        issued beside it (``begin``); then the expand (``finish``), or, with ``defer`` and a started
        update, y alone and the update still to add for y's consumer."""
        if self.backend == "torch":                                # no early shrink, no consumer fusion
            y = linear.weight_q.linear(x, linear.bias) if linear.weight is None else F.linear(x, linear.weight,
                                                                                                linear.bias)
            return self.forward(x, y), None
        stacked = self.begin_stacked(x, linear.weight) if linear.weight is not None else None
        if stacked is None:
            pending = self.begin(x)
            if linear.weight is None:                              # a quantized base (FP8, int4, ...)
                y = linear.weight_q.linear(x, linear.bias)         # [num_tokens, out]
            else:
                y = F.linear(x, linear.weight, linear.bias)        # [num_tokens, out]
        else:
            y, pending = stacked
        if not defer or pending.plan is None:                      # nothing issued early: the plain path
            return self.finish(pending, y), None
        pending.y = y
        return y, pending

    def finish_add_rms_norm(self, pending: LoRAPending, x: torch.Tensor, weight: torch.Tensor, eps: float,
                            residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + update + residual), x + update + residual) for this (one-slice) layer's base
        output x with its pending update, in one ``kernels.lora_expand_norm`` launch; like
        ``engine.layers.norm.RMSNorm.forward`` on CUDA, x receives the normalized rows and residual
        the sum (the returned tensors are those two).

        x, residual: [num_tokens, hidden]; weight: [hidden] the norm's.
        """
        from kernels.lora_expand_norm import lora_expand_add_rms_norm

        if pending.side is not None:
            torch.cuda.current_stream().wait_stream(pending.side)
        x2 = x.view(-1, x.shape[-1])
        lora_expand_add_rms_norm(pending.plan.buf, self.lora_b[0], self.state.batch.meta, x2,
                                 weight, eps, residual=residual.view(-1, residual.shape[-1]), out=x2,
                                 slot_stride=pending.plan.slot_stride, pages=self.state.pages)
        return x, residual

    def finish_rotary_write_kv(self, pending: LoRAPending, positions: torch.Tensor, q: torch.Tensor,
                               k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                               rotary_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, *, k_scale: float = 1.0,
                               v_scale: float = 1.0) -> None:
        """``kernels.kv_write.rotary_write_kv`` on views q, k, v of this (q/k/v) layer's base output
        with the pending update added first, in one ``kernels.lora_rotary_write_kv`` launch.
        Arguments as ``rotary_write_kv``'s."""
        from kernels.lora_rotary_write_kv import lora_rotary_write_kv

        if pending.side is not None:
            torch.cuda.current_stream().wait_stream(pending.side)
        lora_rotary_write_kv(positions, q, k, v, cos, sin, rotary_dim, k_cache, v_cache, slot_mapping,
                             pending.plan.buf, self.lora_b, self.state.batch.meta.token_lora_slots,
                             pending.plan.slot_stride, k_scale=k_scale, v_scale=v_scale, pages=self.state.pages)

    def _silu_mul_config(self, num_tokens: int, num_active: int, device: torch.device) -> LoRAExpandConfig:
        """``finish_silu_mul``'s launch config (the policy's ``lora_expand`` overrides apply)."""
        from kernels.lora_expand_silu_mul import lora_expand_silu_mul_config

        return lora_expand_silu_mul_config(num_tokens, num_active, self.output_sizes[0], device,
                                           self.expand_overrides)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """x as [num_tokens, input_size], checked against the step's batch (regrouped first for an encoder
        stage whose rows per media item differ: ``LoRABatchState.regroup``)."""
        x2 = x.reshape(-1, self.input_size)
        if x2.shape[0] != self.state.batch.num_tokens and self.state.regroup is not None:
            self.state.regroup(x2.shape[0])
        num_tokens = self.state.batch.num_tokens
        assert x2.shape[0] == num_tokens, f"LoRA batch has {num_tokens} tokens, the layer got {x2.shape[0]}"
        return x2

    def _forward_triton(self, x: torch.Tensor, y: torch.Tensor, batch) -> None:
        x = x.contiguous()
        plan = self._plan_split(x, batch)
        self._shrink(x, plan, batch)
        self._expand(plan, y, batch)

    def launch_key(self, num_tokens: int, num_active: int) -> tuple:
        """The launch configs ``forward`` takes on the Triton backend for a step of num_tokens tokens
        over num_active adapters: with the layer's shapes, what Triton compiles a kernel for
        (``LoRAManager.warm_up_kernels`` compiles each distinct key once)."""
        from kernels.lora_expand import lora_expand_config
        from kernels.lora_shrink import lora_shrink_config

        dev, outs = self.lora_a.device, tuple(self.output_sizes)
        silu_mul = self._silu_mul_config(num_tokens, num_active, dev) if self.fuse_silu_mul else None
        if self.takes_stacked(num_tokens):
            return ("stacked", lora_expand_config(num_tokens, num_active, outs, dev, self.expand_overrides),
                    silu_mul)
        norm = None
        if self.defers(num_tokens, Feeds.ADD_RMS_NORM):
            from kernels.lora_expand_norm import launch_shape
            norm = launch_shape(num_tokens, num_active, dev)
        return ("split", lora_shrink_config(num_tokens, num_active, self.num_slices, self.input_size, dev,
                                            self.shrink_overrides),
                lora_expand_config(num_tokens, num_active, outs, dev, self.expand_overrides), silu_mul, norm)

    def _plan_split(self, x: torch.Tensor, batch) -> SplitPlan:
        from kernels.lora_expand import lora_expand_config
        from kernels.lora_shrink import lora_shrink_config

        meta, num_tokens = batch.meta, x.shape[0]
        shrink_cfg = lora_shrink_config(num_tokens, meta.num_active, self.num_slices, self.input_size,
                                        x.device, self.shrink_overrides)
        expand_cfg = lora_expand_config(num_tokens, meta.num_active, tuple(self.output_sizes), x.device,
                                        self.expand_overrides)
        buf = self.state.shrink_buffer(self.num_slices, shrink_cfg.split_k, num_tokens, self.max_rank,
                                       x.device)                                  # [S, split_k, T, R] f32
        return SplitPlan(buf, shrink_cfg, expand_cfg)

    def _shrink(self, x: torch.Tensor, plan: SplitPlan, batch) -> None:
        """plan.buf = per-split partials of x @ A^T (x contiguous)."""
        from kernels.lora_shrink import lora_shrink

        lora_shrink(x, self.lora_a, batch.meta, plan.buf, 1.0, config=plan.shrink_cfg, pages=self.state.pages)

    def _expand(self, plan: SplitPlan, y: torch.Tensor, batch) -> None:
        """y += sum of plan.buf's partials @ B^T, per slice."""
        from kernels.lora_expand import lora_expand

        lora_expand(plan.buf, self.lora_b, batch.meta, y, self.slice_offsets, add_inputs=True,
                    config=plan.expand_cfg, slot_stride=plan.slot_stride, pages=self.state.pages)

    def _slot_weights(self, lora_slot: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(A [S, R, in], per slice B [out_s, R]) of one slot: its own rank's rows when pooled."""
        if not self.pooled:
            return self.lora_a[:, lora_slot], [b[lora_slot] for b in self.lora_b]
        rows = self.state.slot_rows[lora_slot]                                         # [rank_l]
        pages, sub = rows // PAGE_ROWS, rows % PAGE_ROWS
        return self.lora_a[:, rows], [b[pages, :, sub].t() for b in self.lora_b]

    def _torch_slot(self, lora_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A^T [in, S * r], block-diagonal B^T [S * r, sum(out_s)]) of one slot in float32 (``_torch_slots``):
        slice s's rank rows are columns [s * r, (s + 1) * r) of A^T and feed only its own output columns."""
        cached = self._torch_slots.get(lora_slot)
        if cached is not None:
            return cached
        a, lora_b = self._slot_weights(lora_slot)                                       # [S, R, in], [out_s, R]
        used = (a.abs().sum(dim=2) != 0) | torch.stack([(b != 0).any(dim=0) for b in lora_b])   # [S, R]
        nz = used.any(dim=0).nonzero()
        rank = int(nz[-1]) + 1 if nz.numel() else 1              # rows past every slice's rank are zero padding
        S = self.num_slices
        a_t = a[:, :rank].float().reshape(S * rank, self.input_size).t().contiguous()  # [in, S * r]
        b_bd = a_t.new_zeros(S * rank, sum(self.output_sizes))                          # [S * r, sum(out_s)]
        for s, (off, size) in enumerate(zip(self.slice_offsets, self.output_sizes)):
            b_bd[s * rank:(s + 1) * rank, off:off + size] = lora_b[s][:, :rank].float().t()
        self._torch_slots[lora_slot] = a_t, b_bd
        return a_t, b_bd

    def _forward_torch(self, x: torch.Tensor, y: torch.Tensor, batch) -> None:
        if self.pooled:
            for seg in batch.segments:
                xs = x if seg.token_ids is None else x.index_select(0, seg.token_ids)     # [n, in]
                a, lora_b = self._slot_weights(seg.lora_slot)                              # [S, R, in], [out_s, R]
                buf = torch.matmul(xs.float().unsqueeze(0), a.float().transpose(1, 2))    # [S, n, R] f32
                delta = torch.cat([buf[s] @ lora_b[s].float().t()
                                   for s in range(self.num_slices)], dim=1)                # [n, sum out_s]
                self._add_rows(y, delta, seg.token_ids)
            return
        for seg in batch.segments:
            xs = x if seg.token_ids is None else x.index_select(0, seg.token_ids)         # [n, in]
            a_t, b_bd = self._torch_slot(seg.lora_slot)
            buf = torch.mm(xs if xs.dtype == torch.float32 else xs.float(), a_t)         # [n, S * r] f32
            if seg.token_ids is None and y.dtype == torch.float32 and y.is_contiguous():
                y.addmm_(buf, b_bd)
            else:
                self._add_rows(y, buf @ b_bd, seg.token_ids)                                # [n, sum out_s]

    @staticmethod
    def _add_rows(y: torch.Tensor, delta: torch.Tensor, token_ids: Optional[torch.Tensor]) -> None:
        """y[token_ids] += delta (every row of y when token_ids is None).

        y: [num_tokens, sum(out_s)]; delta: [n, sum(out_s)] float32.
        """
        # NOTE: delta has every column of y (zero where the adapter has no slice), so one row-wise add into the
        # contiguous y; index_add_ on a column view is very slow on CPU.
        if token_ids is None:
            y += delta.to(y.dtype)
        else:
            y.index_add_(0, token_ids, delta.to(y.dtype))

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_sizes}, max_loras={self.max_loras}, "
                f"max_rank={self.max_rank}, backend={self.backend}")
