"""RMSNorm, computed in float32 like transformers'.

On CUDA one fused Triton kernel (``kernels.layer_ops.add_rms_norm``) does the residual add and
the norm, updating the residual in place; on CPU ``kernels.cpu_layer_ops``' C op does the same where
the runner loaded it; ``forward_torch`` (``kernels.reference.rms_norm_ref``) is their twin and the CPU
path without it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from engine.forward_context import current_cpu_ops
from engine.layers.adapter import take_update
from kernels.reference import rms_norm_ref


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual).

        x: [num_tokens, hidden], or with ``residual`` split-K partials [num_parts, num_tokens,
        hidden] whose sum is x (``Linear.forward_base``). When x is a projection's output whose
        adapter update is still pending (``engine.layers.adapter``), the update is added here:
        inside the add + RMSNorm with a residual (one launch), before the norm without one.
        NOTE: on CUDA, with ``residual`` given, ``x`` and ``residual`` are overwritten (the
        returned tensors are a 2-D x and residual); callers never reuse them. The CPU C op overwrites
        ``residual`` the same way.
        """
        pending = take_update(x)
        if pending is not None:
            if residual is not None:
                return pending.finish_add_rms_norm(self.weight, self.eps, residual)
            x = pending.finish()
        if x.is_cuda:
            from kernels.layer_ops import add_rms_norm
            if residual is None:
                return add_rms_norm(x, self.weight, self.eps)
            out = x if x.dim() == 2 else None
            return add_rms_norm(x, self.weight, self.eps, residual=residual, out=out), residual
        ops = current_cpu_ops()
        if (ops is not None and x.dim() == 2 and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and (residual is None or (residual.dtype == torch.float32 and residual.is_contiguous()))):
            out = ops.add_rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        return self.forward_torch(x, residual)

    def forward_torch(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """``forward`` in torch, without writing x or residual (``kernels.reference.rms_norm_ref``). Float32
        rows take ``torch.rms_norm``, the same arithmetic in one kernel instead of the reference's five ops."""
        if x.dim() == 2 and x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if residual is not None:
                x = x + residual
                return torch.rms_norm(x, self.weight.shape, self.weight, self.eps), x
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return rms_norm_ref(x, self.weight, self.eps, residual)
