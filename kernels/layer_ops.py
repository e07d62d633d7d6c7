"""Fused elementwise layer ops for the CUDA path: add + RMSNorm, rotary (neox, in place), SiLU-and-mul.

Each replaces a chain of 3 to 15 small torch kernels per layer call with one launch. A batch-1
decode step is bound by its weight reads, and unfused these short launches, dozens per layer,
would add a large share on top of them, so fusing them is what keeps the step near its memory
floor (``benchmarks/RESULTS.md``, "Decode step time vs its memory floor"). The torch twins are
``kernels.reference.rms_norm_ref`` and ``silu_and_mul_ref`` (which the engine's CPU path runs) and
``engine.layers.rotary.RotaryEmbedding.forward_torch``; ``tests/kernels/test_kernel_layer_ops.py``
compares the two.

Numerics follow transformers' modules: the residual sum is rounded to the activation dtype
before the norm reads it, the normalized value is rounded before the weight multiply, and
SiLU's output is rounded before the ``* up``; everything else is float32.
"""

from __future__ import annotations

from typing import Optional

import torch

import triton
import triton.language as tl

from kernels.utils import FLOAT_DTYPES, check_tensor, next_power_of_2


# ----------------------------------------------------------------------------------------
# add + RMSNorm
# ----------------------------------------------------------------------------------------
@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, hidden, eps,
                         stride_x, stride_r, stride_o, stride_part,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, NUM_PARTS: tl.constexpr = 1):
    """Semantics, one program per row t (dtype = residual's dtype, or x's without a residual;
    math in float32):

        x_t = x[0][t] + x[1][t] + ... + x[NUM_PARTS - 1][t]     (NUM_PARTS > 1: split-K partials,
                                                                  summed in this order)
        if HAS_RESIDUAL:
            s = dtype(x_t + residual[t]); residual[t] = s       (in place)
        else:
            s = x_t
        n = dtype(s / sqrt(mean(s^2) + eps))
        out[t] = dtype(weight * n)

    stride_part: elements between two partials (x[p] starts at x_ptr + p * stride_part).
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    for part in tl.static_range(1, NUM_PARTS):
        x += tl.load(x_ptr + part * stride_part + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / hidden
    n = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * n).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm of ``x`` (or of ``x + residual``, which is then stored into ``residual``).

    Args:
        x: [num_tokens, hidden], float16/bfloat16/float32, last dim contiguous; or split-K
            partials [num_parts, num_tokens, hidden] (``engine.layers.fused``: a projection run as
            one batched GEMM over slices of K), summed here in float32, any float dtype; partials
            need ``residual``.
        weight: [hidden], in the activation dtype (x's, or residual's with partials).
        eps: added to the mean square.
        residual: optional [num_tokens, hidden], last dim contiguous; updated in place.
        out: optional output ([num_tokens, hidden], the activation dtype); may be a 2-D ``x``.

    Returns:
        out: the normalized rows.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected [num_tokens, hidden] or [num_parts, num_tokens, hidden], got {tuple(x.shape)}.")
    num_parts = x.shape[0] if x.dim() == 3 else 1
    num_tokens, hidden = x.shape[-2:]
    if x.dim() == 3 and residual is None:
        raise ValueError("x: split-K partials ([num_parts, num_tokens, hidden]) need a residual to sum into.")
    dtype = x.dtype if residual is None else residual.dtype
    if residual is not None:
        check_tensor("residual", residual, dtypes=FLOAT_DTYPES if num_parts > 1 else (x.dtype,),
                     shape=(num_tokens, hidden), device=x.device, last_dim_contiguous=True)
    check_tensor("weight", weight, dtypes=(dtype,), shape=(hidden,), device=x.device, contiguous=True)
    if out is None:
        out = torch.empty(num_tokens, hidden, device=x.device, dtype=dtype)   # [num_tokens, hidden]
    check_tensor("out", out, dtypes=(dtype,), shape=(num_tokens, hidden), device=x.device,
                 last_dim_contiguous=True)
    if num_tokens == 0:
        return out
    block = next_power_of_2(hidden)
    _add_rms_norm_kernel[(num_tokens,)](
        x, residual if residual is not None else x, weight, out, hidden, float(eps),
        x.stride(-2), residual.stride(0) if residual is not None else 0, out.stride(0),
        x.stride(0) if num_parts > 1 else 0,
        HAS_RESIDUAL=residual is not None, BLOCK=block, NUM_PARTS=num_parts,
        num_warps=min(16, max(1, block // 256)))
    return out


# ----------------------------------------------------------------------------------------
# Rotary embedding (neox / rotate-half layout), in place on q and k
# ----------------------------------------------------------------------------------------
@triton.jit
def _rotary_cos_sin(cos_ptr, sin_ptr, positions_ptr, tok, stride_cs, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """Row positions[tok] of the cos / sin tables: ([1, HALF_PAD] cos, sin, [HALF_PAD] dims, mask)."""
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    d_ok = d < HALF
    c = tl.load(cos_ptr + pos * stride_cs + d, mask=d_ok, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_cs + d, mask=d_ok, other=0.0)[None, :]
    return c, s, d, d_ok


@triton.jit
def _rotate_heads_(x_ptr, tok, stride_tok, stride_head, c, s, d, d_ok,
                   NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
    """Rotate the first 2 * HALF dims of every head of token ``tok`` in place.

    Returns the rotated halves ([HEADS_PAD, HALF_PAD] each, in x's dtype), the head indices and
    the mask. NOTE: each thread stores only the elements it loaded (the halves sit side by side
    in one layout), so the in-place update has no cross-thread read-after-write hazard.
    """
    h = tl.arange(0, HEADS_PAD)
    m = (h[:, None] < NUM_HEADS) & d_ok[None, :]
    off = x_ptr + tok * stride_tok + h[:, None] * stride_head + d[None, :]
    x1 = tl.load(off, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(off + HALF, mask=m, other=0.0).to(tl.float32)
    r1 = (x1 * c - x2 * s).to(x_ptr.dtype.element_ty)
    r2 = (x2 * c + x1 * s).to(x_ptr.dtype.element_ty)
    tl.store(off, r1, mask=m)
    tl.store(off + HALF, r2, mask=m)
    return r1, r2, h, m


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, positions_ptr,
                   stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_cs,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                   Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    """Semantics, one program per token t (p = positions[t], c = cos[p, :HALF], s = sin[p, :HALF]):

        for x in q[t, h] (every q head) and k[t, h] (every k head):
            x1, x2 = x[:HALF], x[HALF:2 * HALF]          (dims past 2 * HALF are left alone)
            x[:HALF], x[HALF:2 * HALF] = x1 * c - x2 * s, x2 * c + x1 * s     (float32, stored in x's dtype)
    """
    tok = tl.program_id(0).to(tl.int64)
    c, s, d, d_ok = _rotary_cos_sin(cos_ptr, sin_ptr, positions_ptr, tok, stride_cs, HALF, HALF_PAD)
    _rotate_heads_(q_ptr, tok, stride_q_tok, stride_q_head, c, s, d, d_ok, NUM_Q_HEADS, Q_HEADS_PAD, HALF)
    _rotate_heads_(k_ptr, tok, stride_k_tok, stride_k_head, c, s, d, d_ok, NUM_K_HEADS, K_HEADS_PAD, HALF)


def check_rotary_args(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, rotary_dim: int) -> int:
    """Check the rotary inputs shared by ``rotary_embedding_`` and ``kv_write.rotary_write_kv``;
    returns HALF = rotary_dim // 2."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, _, head_dim = q.shape
    dev = q.device
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=dev, last_dim_contiguous=True)
    check_tensor("k", k, shape=(num_tokens, None, head_dim))
    check_tensor("positions", positions, dtypes=(torch.int64, torch.int32), shape=(num_tokens,), device=dev,
                 contiguous=True)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim: {rotary_dim} must be even and in (0, head_dim={head_dim}].")
    half = rotary_dim // 2
    check_tensor("cos", cos, ndim=2, dtypes=(torch.float32,), device=dev, last_dim_contiguous=True)
    check_tensor("sin", sin, dtypes=(torch.float32,), shape=tuple(cos.shape), device=dev,
                 last_dim_contiguous=True)
    if cos.shape[1] < half or cos.stride(0) != sin.stride(0):
        raise ValueError(f"cos/sin: need >= {half} columns and one row stride, got shape "
                         f"{tuple(cos.shape)}, strides {cos.stride()} / {sin.stride()}.")
    return half


def rotary_embedding_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, rotary_dim: int) -> None:
    """Rotate the first ``rotary_dim`` dims of every q and k head in place (neox layout).

    Args:
        positions: [num_tokens] int64 (or int32) absolute positions.
        q: [num_tokens, num_heads, head_dim], last dim contiguous (views of a packed qkv work).
        k: [num_tokens, num_kv_heads, head_dim], q's dtype, last dim contiguous.
        cos, sin: [max_position, >= rotary_dim / 2] float32 tables, row stride shared; column j
            of row p is cos / sin of p * inv_freq[j] (with any rope scaling folded in).
        rotary_dim: even, <= head_dim.
    """
    half = check_rotary_args(positions, q, k, cos, sin, rotary_dim)
    num_tokens, num_heads, _ = q.shape
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        q, k, cos, sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        NUM_Q_HEADS=num_heads, NUM_K_HEADS=k.shape[1], HALF=half,
        Q_HEADS_PAD=next_power_of_2(num_heads), K_HEADS_PAD=next_power_of_2(k.shape[1]),
        HALF_PAD=max(2, next_power_of_2(half)), num_warps=4)


# ----------------------------------------------------------------------------------------
# SiLU-and-mul
# ----------------------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr):
    """Semantics, program (t, j) covers columns [j * BLOCK, (j + 1) * BLOCK) of row t:

        out[t, c] = dtype(dtype(silu(x[t, c])) * x[t, d + c])      (gate | up packed in x)
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x: [num_tokens, 2 * d] (gate | up), last dim contiguous -> [num_tokens, d] = silu(gate) * up."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, width = x.shape
    if width % 2:
        raise ValueError(f"x: last dim {width} must be even (gate | up).")
    d = width // 2
    if out is None:
        out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)   # [num_tokens, d]
    check_tensor("out", out, dtypes=(x.dtype,), shape=(num_tokens, d), device=x.device,
                 last_dim_contiguous=True)
    if num_tokens == 0:
        return out
    block = min(1024, next_power_of_2(d))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
        x, out, d, x.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out
