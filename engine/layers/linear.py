"""Linear layers with packed output slices and an optional LoRA hook."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:
    from lora.layers import LinearLoRASlots, LoRAPending


class Linear(nn.Module):
    """``y = x @ W.T + b`` whose output is the concatenation of ``output_sizes`` slices.

    A packed projection (q/k/v, or gate/up) is one matmul; checkpoints store the slices
    separately, so ``load_slice`` copies each into its rows. ``lora`` (set by the LoRA
    manager) adds the batch's adapter updates in place: ``y += lora(x)`` per token.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(self.output_size, input_size), requires_grad=False)  # [out, in]
        self.bias = nn.Parameter(torch.empty(self.output_size), requires_grad=False) if bias else None
        self.lora: Optional[LinearLoRASlots] = None

    def slice_offsets(self) -> list[int]:
        offs, acc = [], 0
        for s in self.output_sizes:
            offs.append(acc)
            acc += s
        return offs

    def load_slice(self, param_name: str, slice_idx: int, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor (``weight`` or ``bias``) into slice ``slice_idx``."""
        param = getattr(self, param_name)
        if param is None:
            raise ValueError(f"checkpoint has a {param_name} for a projection built without one")
        start = self.slice_offsets()[slice_idx]
        size = self.output_sizes[slice_idx]
        if tensor.shape[0] != size or tensor.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape {tuple(tensor.shape)} does not fit slice {slice_idx} "
                             f"({size} rows of {tuple(param.shape[1:])})")
        param.data[start:start + size].copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None or self.lora.adds_nothing():
            return F.linear(x, self.weight, self.bias)  # [num_tokens, output_size]
        y, pending = self._base_with_lora(x)
        return y if pending is None else self.lora.finish(pending, y)

    def forward_split_k(self, x: torch.Tensor, num_parts: int) -> torch.Tensor:
        """The product without bias or adapter as ``num_parts`` partial products over equal slices
        of the input features: x [num_tokens, input_size] -> [num_parts, num_tokens, output_size],
        whose sum over dim 0 is ``x @ W.T``. One batched GEMM on strided views of x and W (no
        copies); the consumer sums the partials (``kernels.layer_ops.add_rms_norm``). Policy:
        ``engine.layers.fused.split_k_parts``."""
        num_tokens, k = x.shape
        part_k = k // num_parts
        xs = x.view(num_tokens, num_parts, part_k).transpose(0, 1)                # [P, T, K/P]
        ws = self.weight.view(self.output_size, num_parts, part_k).permute(1, 2, 0)  # [P, K/P, N]
        return torch.bmm(xs, ws)                                                   # [P, T, N]

    def forward_deferred(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[LoRAPending]]:
        """(y, pending): like ``forward``, but when the LoRA hook fuses its update into the
        consumer (``LinearLoRASlots.defers``: gate/up into SiLU-and-mul, q/k/v into the rotary + KV
        write, o/down into the add + RMSNorm), y is the base output and ``pending`` the update
        still to add; its consumer must complete it (``pending.owner.finish_silu_mul`` /
        ``finish_rotary_write_kv`` / ``finish_add_rms_norm``, or ``finish``). pending is None when
        y is complete."""
        num_tokens = x.numel() // max(1, x.shape[-1])
        if self.lora is None or self.lora.adds_nothing() or not self.lora.defers(num_tokens):
            return self.forward(x), None
        y, pending = self._base_with_lora(x)
        if pending is not None and pending.plan is None:    # nothing issued early: the plain path
            return self.lora.finish(pending, y), None
        return y, pending

    def _base_with_lora(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[LoRAPending]]:
        """(y, pending) for a step with an adapter update here: the base GEMM with the update still
        to add, over the stacked weight, which gives every slot's shrink too (decode-sized steps,
        ``LinearLoRASlots.begin_stacked``), or the plain one; the LoRA shrink needs x only:
        ``begin`` issues it (on a side stream on CUDA) so it runs alongside the GEMM; ``finish``
        joins it and adds the expand."""
        stacked = self.lora.begin_stacked(x, self.weight)        # decode: the shrink inside the GEMM
        if stacked is not None:
            return stacked
        pending = self.lora.begin(x)
        return F.linear(x, self.weight, self.bias), pending  # [num_tokens, output_size]
