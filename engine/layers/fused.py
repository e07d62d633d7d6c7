"""Decode-step fusions around the projections: norm -> projection and SiLU-and-mul -> projection.

At batch 1-16 a decode step is a chain of weight-bound GEMVs with a tiny elementwise kernel
between each pair (add + RMSNorm before qkv and gate/up, SiLU-and-mul before down). On CUDA,
while a step has at most ``decode_gemv_max_tokens()`` tokens and no adapter update on the
projection, ``kernels.gemv`` runs each pair as one launch: the GEMV recomputes the elementwise
prologue per input chunk instead of reading a materialized activation, and it needs no split-K
reduce. Everywhere else (CPU, prefill-sized steps, a LoRA update in the step) the same functions
run the unfused modules, which are the fused kernels' reference.

Deferred LoRA updates: ``defer=True`` asks the projection for ``Linear.forward_deferred``'s
(y, delta), where delta (float32, or None) is the adapter update the caller still owes y; the next
function takes it as ``x_delta`` and folds it into its first kernel. A caller must consume one
delta before it requests the next (the LoRA delta scratch is shared).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from engine import envs
from engine.layers.activation import silu_and_mul
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm


@functools.lru_cache(maxsize=None)
def decode_gemv_max_tokens() -> int:
    """Largest step (tokens) that takes the fused GEMV path; 0 turns it off (read once)."""
    return envs.decode_gemv_max_tokens()


def use_decode_gemv(linear: Linear, x: torch.Tensor) -> bool:
    """True when ``linear(x)`` may run as ``kernels.gemv`` (CUDA, few tokens, no adapter update)."""
    return (x.is_cuda and 0 < x.shape[0] <= decode_gemv_max_tokens() and x.dtype == linear.weight.dtype
            and x.dim() == 2 and x.stride(-1) == 1 and (linear.lora is None or linear.lora.adds_nothing()))


def norm_linear(norm: RMSNorm, linear: Linear, x: torch.Tensor, residual: Optional[torch.Tensor],
                x_delta: Optional[torch.Tensor] = None, defer: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(linear(norm(s)), s, delta) with s = x' + residual (s = x' when ``residual`` is None) and
    x' = dtype(x + x_delta) (x' = x without one); delta: the projection's deferred adapter update
    (``defer`` only; else None).

    x, residual: [num_tokens, hidden]. NOTE: like ``RMSNorm.forward``, the unfused CUDA path
    overwrites ``x`` and ``residual``; callers never reuse them.
    """
    if x_delta is None and use_decode_gemv(linear, x):
        from kernels.gemv import add_rms_norm_gemv
        return (*add_rms_norm_gemv(x, residual, norm.weight, norm.eps, linear.weight, linear.bias), None)
    if residual is None:
        if x_delta is not None:   # the residual stream is x' itself
            x = (x.float() + x_delta).to(x.dtype)
        h, residual = norm(x), x
    else:
        h, residual = norm(x, residual, x_delta=x_delta)
    y, delta = linear.forward_deferred(h) if defer else (linear(h), None)
    return y, residual, delta


def silu_mul_linear(linear: Linear, gate_up: torch.Tensor, gate_up_delta: Optional[torch.Tensor] = None,
                    defer: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(linear(silu(gate) * up), delta) for gate_up: [num_tokens, 2 * d] (gate | up), first updated
    by ``gate_up_delta`` (float32) when given; delta: the deferred adapter update (``defer`` only)."""
    if gate_up_delta is None and use_decode_gemv(linear, gate_up):
        from kernels.gemv import silu_mul_gemv
        return silu_mul_gemv(gate_up, linear.weight, linear.bias), None
    h = silu_and_mul(gate_up, gate_up_delta)
    return linear.forward_deferred(h) if defer else (linear(h), None)


def linear_forward(linear: Linear, x: torch.Tensor, defer: bool = False
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(linear(x), delta), as one ``kernels.gemv`` launch when the decode path applies; delta: the
    deferred adapter update (``defer`` only; else None)."""
    if use_decode_gemv(linear, x):
        from kernels.gemv import gemv
        return gemv(x, linear.weight, linear.bias), None
    return linear.forward_deferred(x) if defer else (linear(x), None)
