"""4-bit weights with 16-bit activations (W4A16) from GPTQ, AWQ and compressed-tensors ``pack-quantized``
checkpoints: ``W4A16Weight``, built from the projection's ``engine.quantization.slices.Int4Slice``s.

- CUDA: ``kernels.w4a16`` (int4 dequantized in registers), the weight packed along the inputs
  (``qweight`` int32 [in / 8, out], ``scales`` / ``zeros`` [groups, out] in the activations' dtype);
- CPU: the int4 path of ``engine.layers.quantized`` (``Int4Weight``), regrouped at load: a group of G inputs
  is G / 32 groups of 32 with the same scale and zero point, so the values are the checkpoint's exactly
  (the packed kernel keeps scale and zero in bfloat16). Group sizes that are not a multiple of 32 run the
  dequantized float weight.

Act order (GPTQ ``desc_act``, compressed-tensors ``actorder: group``): each input's group is ``g_idx``;
the inputs are permuted once at load so that every group is contiguous, and each call gathers x's
columns in that order (``input_order``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from engine.layers.quantized import INT4_GROUP_SIZE, Int4Weight, quantized_linear
from engine.quantization.slices import Int4Slice


class W4A16Weight:
    """A [out, in] 4-bit weight (module docstring)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 input_order: Optional[torch.Tensor], dtype: torch.dtype) -> None:
        out_features, in_features = q.shape
        self.out_features, self.in_features = out_features, in_features
        self.group_size = group_size
        """Inputs per scale (``in_features``: one per channel)."""
        self.input_order = input_order
        """int64 [in]: the inputs' order that makes groups contiguous (act order); None: as stored."""
        self.device = q.device
        self.cuda = q.is_cuda
        self.cpu_int4: Optional[Int4Weight] = None
        """CPU: the regrouped int4 weight (None: ``float_weight`` runs)."""
        self.float_weight: Optional[torch.Tensor] = None
        """CPU, a group size that is not a multiple of 32: the dequantized weight [out, in]."""
        if self.cuda:
            from kernels.w4a16 import pack_int4_along_k
            self.qweight = pack_int4_along_k(q.t().contiguous())                     # [in / 8, out] int32
            self.scales = scales.t().contiguous().to(dtype)                           # [groups, out]
            self.zeros = zeros.t().contiguous().to(dtype)                             # [groups, out]
        elif group_size % INT4_GROUP_SIZE == 0:
            repeat = group_size // INT4_GROUP_SIZE
            self.cpu_int4 = Int4Weight.from_quantized(q, scales.repeat_interleave(repeat, 1),
                                                      zeros.repeat_interleave(repeat, 1))
        else:
            g = torch.arange(in_features, device=q.device) // group_size
            self.float_weight = ((q.float() - zeros[:, g]) * scales[:, g]).to(dtype)

    @classmethod
    def from_slices(cls, slices: list[Int4Slice], dtype: torch.dtype) -> "W4A16Weight":
        """One weight from the slices of a packed projection (q/k/v, gate/up: stacked along the outputs),
        which must share their group size and, with act order, their inputs' groups."""
        first = slices[0]
        for s in slices[1:]:
            if s.group_size != first.group_size or s.shape[1] != first.shape[1]:
                raise ValueError(f"packed 4-bit slices differ: group size {s.group_size} vs {first.group_size}, "
                                 f"{s.shape[1]} vs {first.shape[1]} inputs.")
            if (s.group_of_input is None) != (first.group_of_input is None) or (
                    s.group_of_input is not None and not torch.equal(s.group_of_input, first.group_of_input)):
                raise ValueError("packed 4-bit slices (e.g. q/k/v) have different g_idx; Chorus stacks them into "
                                 "one projection and needs one input order.")
        q = torch.cat([s.q for s in slices])                                          # [out, in]
        scales = torch.cat([s.scales for s in slices])                                # [out, groups]
        zeros = torch.cat([s.zeros for s in slices])
        order = None
        if first.group_of_input is not None:
            groups = first.group_of_input
            order = torch.argsort(groups, stable=True)
            expected = torch.arange(q.shape[1], device=q.device) // first.group_size
            if torch.equal(groups[order], expected):
                if torch.equal(order, torch.arange(q.shape[1], device=q.device)):
                    order = None                                                      # already in order
                else:
                    q = q[:, order].contiguous()
            else:
                raise ValueError(f"g_idx does not put exactly {first.group_size} inputs in each group.")
        return cls(q, scales, zeros, first.group_size, order, dtype)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, in] -> [T, out] = x @ W.T + bias, in x's dtype."""
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        if self.cuda:
            from kernels.w4a16 import w4a16_matmul
            return w4a16_matmul(x, self.qweight, self.scales, self.zeros, self.group_size, bias)
        if self.cpu_int4 is not None:
            return quantized_linear(x, self.cpu_int4, bias)
        return F.linear(x, self.float_weight.to(x.dtype), bias)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [out, in], inputs in the checkpoint's order."""
        if self.cuda:
            from kernels.w4a16 import dequantize_w4
            w = dequantize_w4(self.qweight, self.scales, self.zeros, self.group_size).t()   # [out, in]
        elif self.cpu_int4 is not None:
            w = self.cpu_int4.dequantize(torch.float32)
        else:
            w = self.float_weight.float()
        if self.input_order is not None:
            restored = torch.empty_like(w)
            restored[:, self.input_order] = w
            w = restored
        return w.to(dtype)
