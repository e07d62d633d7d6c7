"""Per-layer LoRA slot buffers and the batched update ``y += (x @ A^T) @ B^T`` per token.

One ``LinearLoRASlots`` hangs off each adapted ``engine.layers.linear.Linear`` as its ``lora``
hook. Its buffers are preallocated for ``max_loras`` slots of ``max_rank``:

- ``lora_a``: [num_slices, max_loras, max_rank, input_size], one A per output slice (q/k/v or
  gate/up each have their own A);
- ``lora_b_{s}``: [max_loras, output_size_s, max_rank] per slice ``s``, with the adapter's scale
  already folded in.

Ranks below ``max_rank`` are zero-padded, and slices an adapter does not target are zero, so
they add nothing. Compute goes through the Triton shrink/expand kernels on CUDA and through a
segment-wise torch path elsewhere (one matmul pair per active slot, checked against the kernels'
pure-torch twins in the tests).

The Triton path per call: pick the shrink config (its split_k), take a [num_slices, split_k,
num_tokens, max_rank] view of the shared scratch buffer, shrink into it (per-split partials,
plain stores) and expand from it (summing the partials): two launches, no memset.
``CHORUS_LORA_SHRINK_CONFIG`` / ``CHORUS_LORA_EXPAND_CONFIG`` override the kernels' launch
configs (see ``kernels.lora_shrink`` / ``kernels.lora_expand``); ``kernel_overrides_from_env``
reads them, once per layer.

``CHORUS_LORA_KERNEL=fused`` (or ``auto`` for steps of at most
``kernels.lora_fused.FUSED_MAX_TOKENS`` tokens) runs ``kernels.lora_fused.lora_shrink_expand``
instead: one launch, no scratch buffer, the shrink recomputed per column program (for decode);
``CHORUS_LORA_FUSED_CONFIG`` overrides its launch config. Read once per layer too; the default
("split") is the pair above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from lora.batch import LoRABatchState
from lora.peft_adapter import LoRASliceWeights

BACKENDS = ("triton", "torch")


@dataclass(frozen=True)
class LoRAKernelOverrides:
    """Launch-config overrides of the Triton LoRA kernels (parsed ``field=int`` pairs)."""

    shrink: tuple[tuple[str, int], ...] = ()
    """``LoRAShrinkConfig`` fields from CHORUS_LORA_SHRINK_CONFIG."""
    expand: tuple[tuple[str, int], ...] = ()
    """``LoRAExpandConfig`` fields from CHORUS_LORA_EXPAND_CONFIG."""
    fused: tuple[tuple[str, int], ...] = ()
    """``LoRAFusedConfig`` fields from CHORUS_LORA_FUSED_CONFIG."""
    kernel: str = "split"
    """CHORUS_LORA_KERNEL: "split" (shrink + expand), "fused" (``lora_shrink_expand``) or "auto"
    (fused for steps of at most ``kernels.lora_fused.FUSED_MAX_TOKENS`` tokens)."""


def kernel_overrides_from_env() -> LoRAKernelOverrides:
    """Read and validate CHORUS_LORA_SHRINK_CONFIG / CHORUS_LORA_EXPAND_CONFIG /
    CHORUS_LORA_FUSED_CONFIG / CHORUS_LORA_KERNEL (ValueError if bad).

    NOTE: read through ``engine.envs``; imports triton: call it on the Triton path only.
    """
    from engine import envs
    from kernels.lora_expand import LoRAExpandConfig
    from kernels.lora_fused import LoRAFusedConfig
    from kernels.lora_shrink import LoRAShrinkConfig, parse_config_override

    return LoRAKernelOverrides(shrink=parse_config_override(envs.lora_shrink_config(), LoRAShrinkConfig),
                               expand=parse_config_override(envs.lora_expand_config(), LoRAExpandConfig),
                               fused=parse_config_override(envs.lora_fused_config(), LoRAFusedConfig),
                               kernel=envs.lora_kernel())


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
    """

    def __init__(self, input_size: int, output_sizes: list[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, state: LoRABatchState, backend: str) -> None:
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
        self.overrides = kernel_overrides_from_env() if backend == "triton" else LoRAKernelOverrides()
        """Kernel launch-config overrides, read once here."""
        self.register_buffer("lora_a", torch.zeros(
            self.num_slices, max_loras, max_rank, input_size, dtype=dtype, device=device),
            persistent=False)                               # [num_slices, max_loras, max_rank, in]
        for s, size in enumerate(self.output_sizes):
            self.register_buffer(f"lora_b_{s}", torch.zeros(
                max_loras, size, max_rank, dtype=dtype, device=device),
                persistent=False)                           # [max_loras, out_s, max_rank]

    @property
    def lora_b(self) -> list[torch.Tensor]:
        """Per slice: [max_loras, output_size_s, max_rank]."""
        return [getattr(self, f"lora_b_{s}") for s in range(self.num_slices)]

    # ------------------------------------------------------------------ slots
    def set_slice(self, lora_slot: int, slice_idx: int, weights: Optional[LoRASliceWeights]) -> None:
        """Copy one projection's A/B into a slot, zero-padding the rank; None zeroes the slice."""
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

    def clear_slot(self, lora_slot: int) -> None:
        for s in range(self.num_slices):
            self.set_slice(lora_slot, s, None)

    # ------------------------------------------------------------------ compute
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
        batch = self.state.batch
        x2 = x.reshape(-1, self.input_size)
        y2 = y.view(-1, y.shape[-1])
        assert x2.shape[0] == batch.num_tokens, \
            f"LoRA batch has {batch.num_tokens} tokens, the layer got {x2.shape[0]}"
        if self.backend == "triton":
            self._forward_triton(x2, y2, batch)
        else:
            self._forward_torch(x2, y2, batch)
        return y

    def _forward_triton(self, x: torch.Tensor, y: torch.Tensor, batch) -> None:
        if self.overrides.kernel != "split" and self._forward_fused(x, y, batch):
            return
        from kernels.lora_expand import lora_expand, lora_expand_config
        from kernels.lora_shrink import lora_shrink, lora_shrink_config

        meta, num_tokens = batch.meta, x.shape[0]
        shrink_cfg = lora_shrink_config(num_tokens, meta.num_active, self.num_slices, self.input_size,
                                        x.device, self.overrides.shrink)
        expand_cfg = lora_expand_config(num_tokens, meta.num_active, tuple(self.output_sizes), x.device,
                                        self.overrides.expand)
        buf = self.state.shrink_buffer(self.num_slices, shrink_cfg.split_k, num_tokens, self.max_rank,
                                       x.device)                                  # [S, split_k, T, R] f32
        lora_shrink(x.contiguous(), self.lora_a, meta, buf, 1.0, config=shrink_cfg)
        lora_expand(buf, self.lora_b, meta, y, self.slice_offsets, add_inputs=True, config=expand_cfg)

    def _forward_fused(self, x: torch.Tensor, y: torch.Tensor, batch) -> bool:
        """The one-launch kernel when the layer's kernel choice takes it for this step; False: not taken."""
        from kernels.lora_fused import FUSED_MAX_TOKENS, lora_fused_config, lora_shrink_expand

        meta, num_tokens = batch.meta, x.shape[0]
        if self.overrides.kernel == "auto" and num_tokens > FUSED_MAX_TOKENS:
            return False
        cfg = lora_fused_config(num_tokens, meta.num_active, self.input_size, tuple(self.output_sizes),
                                x.device, self.overrides.fused)
        lora_shrink_expand(x.contiguous(), self.lora_a, self.lora_b, meta, y, self.slice_offsets, config=cfg)
        return True

    def _forward_torch(self, x: torch.Tensor, y: torch.Tensor, batch) -> None:
        lora_b = self.lora_b
        for seg in batch.segments:
            xs = x if seg.token_ids is None else x.index_select(0, seg.token_ids)     # [n, in]
            a = self.lora_a[:, seg.lora_slot].float()                                  # [S, R, in]
            buf = torch.matmul(xs.float().unsqueeze(0), a.transpose(1, 2))            # [S, n, R] f32
            delta = torch.cat([buf[s] @ lora_b[s][seg.lora_slot].float().t()
                               for s in range(self.num_slices)], dim=1)                # [n, sum out_s]
            # NOTE: every column of y gets a slice (zero where the adapter has none), so one
            # row-wise add into the contiguous y; index_add_ on a column view is very slow on CPU.
            if seg.token_ids is None:
                y += delta.to(y.dtype)
            else:
                y.index_add_(0, seg.token_ids, delta.to(y.dtype))

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_sizes}, max_loras={self.max_loras}, "
                f"max_rank={self.max_rank}, backend={self.backend}")
