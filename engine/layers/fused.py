"""Decode-step fusions around the projections: norm -> projection and SiLU-and-mul -> projection.

At batch 1-16 a decode step is a chain of weight-bound GEMVs with a tiny elementwise kernel
between each pair (add + RMSNorm before qkv and gate/up, SiLU-and-mul before down). On CUDA,
while a step has at most ``decode_gemv_max_tokens()`` tokens and no adapter update on the
projection, ``kernels.gemv`` runs each pair as one launch: the GEMV recomputes the elementwise
prologue per input chunk instead of reading a materialized activation, and it needs no split-K
reduce. Everywhere else (CPU, prefill-sized steps, a LoRA update in the step) the same functions
run the unfused modules, which are the fused kernels' reference.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch

from engine import envs
from engine.layers.activation import silu_and_mul
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm

if TYPE_CHECKING:
    from lora.layers import LoRAPending


@functools.lru_cache(maxsize=None)
def decode_gemv_max_tokens() -> int:
    """Largest step (tokens) that takes the fused GEMV path; 0 turns it off (read once)."""
    return envs.decode_gemv_max_tokens()


def use_decode_gemv(linear: Linear, x: torch.Tensor) -> bool:
    """True when ``linear(x)`` may run as ``kernels.gemv`` (CUDA, few tokens, no adapter update)."""
    return (x.is_cuda and 0 < x.shape[0] <= decode_gemv_max_tokens() and x.dtype == linear.weight.dtype
            and x.dim() == 2 and x.stride(-1) == 1 and (linear.lora is None or linear.lora.adds_nothing()))


def add_norm(norm: RMSNorm, x: torch.Tensor, residual: Optional[torch.Tensor],
             pending: Optional[LoRAPending] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s), s) with s = x + residual (or x when ``residual`` is None) and, when ``pending``
    holds the adapter update of the projection that produced x (``Linear.forward_deferred``),
    that update added to x inside the same kernel.

    x, residual: [num_tokens, hidden]. NOTE: like ``RMSNorm.forward``, the CUDA paths overwrite
    ``x`` and ``residual``; callers never reuse them.
    """
    if pending is not None:
        return pending.owner.finish_add_rms_norm(pending, norm, x, residual)
    if residual is None:
        return norm(x), x
    return norm(x, residual)


def norm_linear(norm: RMSNorm, linear: Linear, x: torch.Tensor, residual: Optional[torch.Tensor],
                pending: Optional[LoRAPending] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(s)), s) with s as in ``add_norm`` (x's pending adapter update included)."""
    if pending is None and use_decode_gemv(linear, x):
        from kernels.gemv import add_rms_norm_gemv
        return add_rms_norm_gemv(x, residual, norm.weight, norm.eps, linear.weight, linear.bias)
    h, residual = add_norm(norm, x, residual, pending)
    return linear(h), residual


def norm_linear_deferred(norm: RMSNorm, linear: Linear, x: torch.Tensor, residual: Optional[torch.Tensor],
                         pending: Optional[LoRAPending] = None
                         ) -> tuple[torch.Tensor, Optional[LoRAPending], torch.Tensor]:
    """``norm_linear`` that may leave the projection's own adapter update to its consumer
    (``Linear.forward_deferred``): (y, y's pending update or None, s). For gate/up, whose consumer
    is ``silu_mul_linear(..., pending)``."""
    if pending is None and use_decode_gemv(linear, x):
        y, residual = norm_linear(norm, linear, x, residual)
        return y, None, residual
    h, residual = add_norm(norm, x, residual, pending)
    y, y_pending = linear.forward_deferred(h)
    return y, y_pending, residual


def silu_mul_linear(linear: Linear, gate_up: torch.Tensor, pending: Optional[LoRAPending] = None
                    ) -> tuple[torch.Tensor, Optional[LoRAPending]]:
    """(linear(silu(gate) * up), its pending update) for gate_up: [num_tokens, 2 * d] (gate | up).

    ``pending``: the gate/up projection's adapter update still to add (``norm_linear_deferred``),
    added inside the SiLU-and-mul. The output's own update may be left pending too
    (``Linear.forward_deferred``); the caller hands it to ``add_norm`` / ``norm_linear``.
    """
    if pending is not None:
        return linear.forward_deferred(pending.owner.finish_silu_mul(pending, gate_up))
    if use_decode_gemv(linear, gate_up):
        from kernels.gemv import silu_mul_gemv
        return silu_mul_gemv(gate_up, linear.weight, linear.bias), None
    return linear.forward_deferred(silu_and_mul(gate_up))


def linear_forward_deferred(linear: Linear, x: torch.Tensor) -> tuple[torch.Tensor, Optional[LoRAPending]]:
    """(linear(x) without or with its adapter update, the update if pending), as one
    ``kernels.gemv`` launch when the decode path applies."""
    if use_decode_gemv(linear, x):
        from kernels.gemv import gemv
        return gemv(x, linear.weight, linear.bias), None
    return linear.forward_deferred(x)
