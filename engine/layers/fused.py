"""Decode-step fusions on a projection's input side: norm -> projection and SiLU-and-mul -> projection.

At batch 1-2 a decode step is a chain of weight-bound GEMVs with a tiny elementwise kernel
between each pair (add + RMSNorm before qkv and gate/up, SiLU-and-mul before down). On CUDA,
while a step has at most ``KernelPolicy.decode_gemv_max_tokens`` tokens and no adapter update on
the projection (a float weight or an FP8 one, ``Linear.decode_gemv_weight``), ``kernels.gemv`` runs
each pair as one launch: the GEMV recomputes the elementwise prologue per input chunk instead of
reading a materialized activation, and it needs no split-K reduce. Everywhere else (CPU, larger
steps, an adapter update in the step) the same functions run the unfused modules, which are the
fused kernels' reference. The output side (split-K partials, adapter updates left to the consumer)
is ``Linear.forward``'s.
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.forward_context import current_policy
from engine.layers.activation import silu_and_mul
from engine.layers.adapter import has_pending_update
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm


def norm_linear(norm: RMSNorm, linear: Linear, x: torch.Tensor, residual: Optional[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(s)), s) with s = x + residual, or s = x when ``residual`` is None.

    x, residual: [num_tokens, hidden] (x may be split-K partials or a projection output with a
    pending adapter update: the norm completes both). NOTE: like ``RMSNorm.forward``, the unfused
    CUDA path overwrites ``x`` and ``residual``; callers never reuse them.
    """
    policy = current_policy()
    if not has_pending_update() and linear.uses_decode_gemv(x, policy):
        from kernels.gemv import add_rms_norm_gemv
        weight, scale, block = linear.decode_gemv_weight()
        return add_rms_norm_gemv(x, residual, norm.weight, norm.eps, weight, linear.bias, weight_scale=scale,
                                 scale_block=block, override=policy.gemv)
    h, residual = (norm(x), x) if residual is None else norm(x, residual)
    return linear(h), residual


def silu_mul_linear(linear: Linear, gate_up: torch.Tensor) -> torch.Tensor:
    """linear(silu(gate) * up) for gate_up: [num_tokens, 2 * d] (gate | up), whose adapter update
    (if pending) SiLU-and-mul adds."""
    policy = current_policy()
    if not has_pending_update() and linear.uses_decode_gemv(gate_up, policy):
        from kernels.gemv import silu_mul_gemv
        weight, scale, block = linear.decode_gemv_weight()
        return silu_mul_gemv(gate_up, weight, linear.bias, weight_scale=scale, scale_block=block,
                             override=policy.gemv)
    return linear(silu_and_mul(gate_up))
