"""SiLU-and-mul for gated MLPs (one Triton kernel on CUDA, torch elsewhere)."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d] = silu(gate) * up."""
    if x.is_cuda:
        from kernels.layer_ops import silu_and_mul as silu_and_mul_triton
        return silu_and_mul_triton(x)
    return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """The twin of ``kernels.layer_ops.silu_and_mul`` and the CPU path."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
