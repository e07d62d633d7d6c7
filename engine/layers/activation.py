"""SiLU-and-mul for gated MLPs (one Triton kernel on CUDA, ``kernels.cpu_layer_ops``' C op on CPU where the
runner loaded it, torch elsewhere)."""

from __future__ import annotations

import torch

from engine.forward_context import current_cpu_ops
from engine.layers.adapter import take_update
from kernels.reference import silu_and_mul_ref


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d] = silu(gate) * up. When x is a gate/up
    projection's output whose adapter update is pending (``engine.layers.adapter``), the update is
    added inside (one launch)."""
    pending = take_update(x)
    if pending is not None:
        return pending.finish_silu_mul()
    if x.is_cuda:
        from kernels.layer_ops import silu_and_mul as silu_and_mul_triton
        return silu_and_mul_triton(x)
    ops = current_cpu_ops()
    if ops is not None and x.dim() == 2 and x.dtype == torch.float32:
        return ops.silu_mul(x)
    return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """The twin of ``kernels.layer_ops.silu_and_mul`` and the CPU path
    (``kernels.reference.silu_and_mul_ref``)."""
    return silu_and_mul_ref(x)
