"""SiLU-and-mul for gated MLPs (one Triton kernel on CUDA, torch elsewhere)."""

from typing import Optional

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor, x_delta: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d] = silu(gate) * up.

    x_delta: optional float32 [num_tokens, 2 * d], a pending update of x (a deferred LoRA delta):
    x is first replaced by dtype(x + x_delta).
    """
    if x.is_cuda:
        from kernels.layer_ops import silu_and_mul as silu_and_mul_triton
        return silu_and_mul_triton(x, x_delta=x_delta)
    return silu_and_mul_torch(x, x_delta)


def silu_and_mul_torch(x: torch.Tensor, x_delta: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The twin of ``kernels.layer_ops.silu_and_mul`` and the CPU path."""
    if x_delta is not None:
        x = (x.float() + x_delta).to(x.dtype)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
