"""Decode-step fusions around the projections: norm -> projection and SiLU-and-mul -> projection.

At batch 1-16 a decode step is a chain of weight-bound GEMVs with a tiny elementwise kernel
between each pair (add + RMSNorm before qkv and gate/up, SiLU-and-mul before down). On CUDA,
while a step has at most ``decode_gemv_max_tokens()`` tokens and no adapter update on the
projection, ``kernels.gemv`` runs each pair as one launch: the GEMV recomputes the elementwise
prologue per input chunk instead of reading a materialized activation, and it needs no split-K
reduce. Everywhere else (CPU, prefill-sized steps, a LoRA update in the step) the same functions
run the unfused modules, which are the fused kernels' reference.

Split-K into the norm: o_proj's and down_proj's outputs only feed the next add + RMSNorm. When a
step's output tiles would fill at most half the GPU (``split_k_parts``: decode-sized batches), each
runs as one batched GEMM over two halves of K and the add + RMSNorm sums the two partials: the
GEMM fills twice the SMs without cuBLAS's own split-K reduce kernel (H200, Llama-3-8B, batch 256:
down_proj 48.5 -> 44.4 us, o_proj 17.6 -> 14.6 us; ``benchmarks/sweeps/splitk_sweep.py``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch

from engine import envs
from engine.layers.activation import silu_and_mul
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from kernels.utils import num_sms

if TYPE_CHECKING:
    from lora.layers import LoRAPending


@functools.lru_cache(maxsize=None)
def decode_gemv_max_tokens() -> int:
    """Largest step (tokens) that takes the fused GEMV path; 0 turns it off (read once)."""
    return envs.decode_gemv_max_tokens()


@functools.lru_cache(maxsize=None)
def gemv_override() -> tuple[tuple[str, int], ...]:
    """CHORUS_GEMV_CONFIG's ``kernels.gemv.GemvConfig`` field overrides, passed to every GEMV launch
    (read once)."""
    return tuple(sorted(envs.gemv_config().items()))


def use_decode_gemv(linear: Linear, x: torch.Tensor) -> bool:
    """True when ``linear(x)`` may run as ``kernels.gemv`` (CUDA, few tokens, no adapter update)."""
    return (x.is_cuda and 0 < x.shape[0] <= decode_gemv_max_tokens() and x.dtype == linear.weight.dtype
            and x.dim() == 2 and x.stride(-1) == 1 and (linear.lora is None or linear.lora.adds_nothing()))


SPLIT_K_TILE = 128
"""Output tile edge (rows and columns) of cuBLAS's kernels for decode-sized bf16 GEMMs on Hopper
(profiled: 128x64 to 256x128); ``split_k_parts`` counts tiles of this size."""
SPLIT_K_MIN_K = 2048
"""Smallest input size worth halving: each half keeps >= 1024 of K to accumulate over."""


@functools.lru_cache(maxsize=None)
def split_k_enabled() -> bool:
    """CHORUS_GEMM_SPLIT_K (read once): 0 turns the split-K path off."""
    return envs.gemm_split_k()


def split_k_parts(linear: Linear, x: torch.Tensor) -> int:
    """Partial products to run ``linear(x)`` as (``Linear.forward_split_k``; 1: a plain GEMM).
    Only for a consumer that sums partials (the add + RMSNorm after o_proj and down_proj), on
    CUDA, in bfloat16 (float32's range, so an unrounded half cannot overflow where the sum does
    not), without bias or an adapter update in the step; then by shape (``split_k_parts_for``)."""
    if not (x.is_cuda and x.dim() == 2 and x.dtype == torch.bfloat16 and linear.weight.dtype == x.dtype
            and x.is_contiguous() and linear.bias is None and split_k_enabled()
            and (linear.lora is None or linear.lora.adds_nothing())):
        return 1
    return split_k_parts_for(x.shape[0], linear.input_size, linear.output_size, num_sms(x.device))


def split_k_parts_for(num_tokens: int, k: int, n: int, sms: int) -> int:
    """2 when an [num_tokens, k] x [k, n] GEMM's output tiles fill at most half of ``sms`` SMs,
    the step is larger than the fused GEMV path takes, and K >= ``SPLIT_K_MIN_K`` splits into
    16-byte aligned halves; else 1."""
    if num_tokens <= decode_gemv_max_tokens() or k < SPLIT_K_MIN_K or k % 16:
        return 1
    tiles = -(-num_tokens // SPLIT_K_TILE) * -(-n // SPLIT_K_TILE)
    return 2 if 2 * tiles <= sms else 1


def norm_linear(norm: RMSNorm, linear: Linear, x: torch.Tensor, residual: Optional[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(s)), s) with s = x + residual, or s = x when ``residual`` is None.

    x, residual: [num_tokens, hidden]. NOTE: like ``RMSNorm.forward``, the unfused CUDA path
    overwrites ``x`` and ``residual``; callers never reuse them.
    """
    if use_decode_gemv(linear, x):
        from kernels.gemv import add_rms_norm_gemv
        return add_rms_norm_gemv(x, residual, norm.weight, norm.eps, linear.weight, linear.bias,
                                 override=gemv_override())
    h, residual = _add_norm(norm, x, residual)
    return linear(h), residual


def norm_linear_deferred(norm: RMSNorm, linear: Linear, x: torch.Tensor, residual: Optional[torch.Tensor],
                         x_pending: Optional[LoRAPending] = None
                         ) -> tuple[torch.Tensor, Optional[LoRAPending], torch.Tensor]:
    """``norm_linear`` that may leave the projection's adapter update to its consumer
    (``Linear.forward_deferred``): (y, pending or None, s). For q/k/v (consumer: the attention's
    rotary + KV write) and gate/up (``silu_mul_linear_deferred(..., pending)``). ``x_pending``: the
    update x itself still lacks (from o_proj or down_proj), added inside the norm."""
    if x_pending is None and use_decode_gemv(linear, x):
        y, residual = norm_linear(norm, linear, x, residual)
        return y, None, residual
    h, residual = _add_norm(norm, x, residual, x_pending)
    y, pending = linear.forward_deferred(h)
    return y, pending, residual


def _add_norm(norm: RMSNorm, x: torch.Tensor, residual: Optional[torch.Tensor],
              x_pending: Optional[LoRAPending] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s), s) with s = x (+ x_pending's update) + residual, or s = x when ``residual`` is None."""
    if x_pending is not None:
        if residual is None:
            x = x_pending.owner.finish(x_pending, x)
        else:
            return norm.forward_pending(x, residual, x_pending)
    return (norm(x), x) if residual is None else norm(x, residual)


def silu_mul_linear(linear: Linear, gate_up: torch.Tensor, pending: Optional[LoRAPending] = None) -> torch.Tensor:
    """linear(silu(gate) * up) for gate_up: [num_tokens, 2 * d] (gate | up); ``pending``: the
    gate/up projection's adapter update still to add (``norm_linear_deferred``), added inside the
    SiLU-and-mul."""
    if pending is not None:
        return linear(pending.owner.finish_silu_mul(pending, gate_up))
    if use_decode_gemv(linear, gate_up):
        from kernels.gemv import silu_mul_gemv
        return silu_mul_gemv(gate_up, linear.weight, linear.bias, override=gemv_override())
    return linear(silu_and_mul(gate_up))


def silu_mul_linear_deferred(linear: Linear, gate_up: torch.Tensor, pending: Optional[LoRAPending] = None
                             ) -> tuple[torch.Tensor, Optional[LoRAPending]]:
    """``silu_mul_linear`` that may leave the projection's own update to its consumer (the next
    add + RMSNorm): (y, pending or None), as ``linear_forward_deferred``."""
    if pending is not None:
        return linear_forward_deferred(linear, pending.owner.finish_silu_mul(pending, gate_up))
    if use_decode_gemv(linear, gate_up):
        return silu_mul_linear(linear, gate_up), None
    return linear_forward_deferred(linear, silu_and_mul(gate_up))


def linear_forward_deferred(linear: Linear, x: torch.Tensor) -> tuple[torch.Tensor, Optional[LoRAPending]]:
    """(y, pending) for a projection whose consumer is the add + RMSNorm (o_proj, down_proj):
    ``linear_forward``; or y as split-K partials [parts, num_tokens, N] (``split_k_parts``), which
    the norm sums; or ``Linear.forward_deferred`` when an adapter update runs here (the norm
    completes pending)."""
    if use_decode_gemv(linear, x):
        return linear_forward(linear, x), None
    parts = split_k_parts(linear, x)
    if parts > 1:
        return linear.forward_split_k(x, parts), None
    return linear.forward_deferred(x)


def linear_forward(linear: Linear, x: torch.Tensor) -> torch.Tensor:
    """linear(x), as one ``kernels.gemv`` launch when the decode path applies."""
    if use_decode_gemv(linear, x):
        from kernels.gemv import gemv
        return gemv(x, linear.weight, linear.bias, override=gemv_override())
    return linear(x)
