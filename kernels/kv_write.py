"""Store this step's K/V rows into the paged cache at their slots (Triton kernels).

``write_kv``: one program per token copies all of its KV heads for both K and V; padding tokens
(slot < 0) are skipped. The torch twin is ``kernels.reference.write_kv_ref``.

``rotary_write_kv``: the rotary embedding of q and k fused with that write (the model's path on
CUDA: one launch per layer instead of two), optionally after a per-head RMSNorm of q and of k
(``QKNormWeights``: Qwen3's and Gemma 3's ``q_norm`` / ``k_norm``, so those models pay no launch for their
norms). Twin: ``kernels.reference.rotary_write_kv_ref``.

An FP8 cache (``FP8_KV_DTYPE``, e4m3) holds K / k_scale and V / v_scale with per-tensor scales
(``cache_value``: the quantize on write that every kernel writing K/V uses; readers multiply the
stored values by the scales, ``kernels.attention_tile``). Twin of the quantize: ``fp8_quantize_ref``.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

import triton
import triton.language as tl

from kernels.layer_ops import _rotary_cos_sin, _rotate_heads_, check_rotary_args
from kernels.utils import FLOAT_DTYPES, check_tensor, next_power_of_2

FP8_KV_DTYPE = torch.float8_e4m3fn
"""The FP8 KV cache element type (e4m3: 4 exponent bits, 3 mantissa bits, no infinities; Triton's
``tl.float8e4nv``)."""
FP8_E4M3_MAX = 448.0
"""Largest finite e4m3 value: quantized K/V saturate at +-448."""
KV_CACHE_DTYPES = FLOAT_DTYPES + (FP8_KV_DTYPE,)
"""Cache element types the KV kernels take (FP8 with per-tensor scales, the float ones without)."""


@triton.jit
def _round_to_e4m3(y):
    """y (float32, |y| <= 448) rounded to the nearest e4m3 value, ties to even, still in float32, so
    the cast that follows is exact: the same value on the GPU (whose cast rounds alike) and under
    TRITON_INTERPRET=1 (whose float-to-fp8 cast truncates carries). Adding then subtracting
    1.5 * 2^(e + 20), e = max(exponent(y), -6), rounds |y| to a multiple of 2^(e - 3): three
    mantissa bits, and the subnormal step 2^-9 below 2^-6."""
    bits = y.to(tl.int32, bitcast=True)
    exp_biased = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
    magic = (((exp_biased + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (tl.abs(y) + magic) - magic
    # y's sign bit on r: -0.0 included (a negation of r may compile to 0 - r, which gives +0.0).
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def cache_value(x, scale, cache_ptr):
    """x (float32) as the cache at ``cache_ptr`` stores it: cast to its element type, or for an FP8
    cache e4m3(clamp(x / scale, -448, 448)) (round to nearest even, IEEE division)."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        return _round_to_e4m3(y).to(tl.float8e4nv)
    else:
        return x.to(cache_ptr.dtype.element_ty)


def fp8_quantize_ref(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Twin of ``cache_value`` for an FP8 cache: x / scale in float32 (IEEE division: a tensor divisor, as CUDA
    divides by a host scalar through its reciprocal), saturated, rounded to e4m3."""
    divisor = torch.tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() / divisor).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def check_kv_scales(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The caches' dequantization scales as floats: positive and finite, and 1.0 unless the cache is FP8
    (float caches hold K and V as they are)."""
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not (math.isfinite(s) and s > 0):
            raise ValueError(f"{name}: expected a positive finite host float, got {s!r}.")
        if cache_dtype != FP8_KV_DTYPE and s != 1.0:
            raise ValueError(f"{name}={s}: scales apply to an FP8 KV cache only, this one is {cache_dtype}.")
    return float(k_scale), float(v_scale)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale, v_scale,
                     stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                     stride_c_blk, stride_c_slot, stride_c_head,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    """Semantics:

        for t in range(num_tokens):                 # one program each
          slot = slot_mapping[t]
          if slot < 0: continue                     # padding token
          k_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = k[t]   # all heads, cast to the cache dtype
          v_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = v[t]

    An FP8 cache stores e4m3(clamp(k[t] / k_scale, -448, 448)) and v's likewise (``cache_value``).
    """
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    c_off = ((slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_slot
             + heads[:, None] * stride_c_head + dims[None, :])
    k = tl.load(k_ptr + tok * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    # NOTE: via fp32 (exact for every supported dtype); the interpreter mishandles raw bf16 values.
    k = k.to(tl.float32)
    v = v.to(tl.float32)
    tl.store(k_cache_ptr + c_off, cache_value(k, k_scale, k_cache_ptr), mask=mask)
    tl.store(v_cache_ptr + c_off, cache_value(v, v_scale, v_cache_ptr), mask=mask)


def _check_cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_tokens: int,
                      num_kv_heads: int, head_dim: int, device: torch.device) -> None:
    """The cache and slot checks shared by ``write_kv`` and ``rotary_write_kv``."""
    check_tensor("k_cache", k_cache, ndim=4, dtypes=KV_CACHE_DTYPES, device=device, contiguous=True)
    check_tensor("k_cache", k_cache, shape=(None, None, num_kv_heads, head_dim))
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape), device=device,
                 contiguous=True)
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(num_tokens,), device=device,
                 contiguous=True)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write K/V rows into the paged cache in place.

    Args:
        k, v: [num_tokens, num_kv_heads, head_dim], float16/bfloat16/float32, last dim contiguous
            (token and head strides are free, so views of a fused qkv output work).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, one dtype
            (float, or ``FP8_KV_DTYPE``).
        slot_mapping: [num_tokens] int64; slot = block_id * block_size + offset, < 0 to skip.
        k_scale, v_scale: an FP8 cache's per-tensor scales (it stores k / k_scale, v / v_scale,
            saturated); 1.0 for float caches.
    """
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, num_kv_heads, head_dim = k.shape
    dev = k.device
    check_tensor("v", v, dtypes=FLOAT_DTYPES, shape=tuple(k.shape), device=dev, last_dim_contiguous=True)
    _check_cache_args(k_cache, v_cache, slot_mapping, num_tokens, num_kv_heads, head_dim, dev)
    k_scale, v_scale = check_kv_scales(k_cache.dtype, k_scale, v_scale)
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        HEADS_PAD=next_power_of_2(num_kv_heads), DIM_PAD=next_power_of_2(head_dim),
        num_warps=4,
    )


# ----------------------------------------------------------------------------------------
# Rotary embedding fused with the KV write (one launch instead of two per layer)
# ----------------------------------------------------------------------------------------
class QKNormWeights(NamedTuple):
    """A per-head RMSNorm of q and of k applied before rotary (``qk_norm_ref``): each head row x of q
    (k) becomes dtype(w' * dtype(x / sqrt(mean(x^2) + eps))), w' = q_weight (k_weight), or 1 + weight with
    ``plus_one``; float32 math, dtype = q's."""

    q_weight: torch.Tensor      # [head_dim], q's dtype, contiguous
    k_weight: torch.Tensor      # [head_dim], q's dtype, contiguous
    eps: float                  # added to the mean square
    plus_one: bool = False      # scale by 1 + weight (Gemma's checkpoint convention) instead of weight


def check_qk_norm(qk_norm: QKNormWeights, q: torch.Tensor) -> tuple[float, bool]:
    """Check ``qk_norm`` against q ([num_tokens, num_heads, head_dim]); returns (eps, plus_one) as a host
    float and bool."""
    for name in ("q_weight", "k_weight"):
        check_tensor(f"qk_norm.{name}", getattr(qk_norm, name), dtypes=(q.dtype,), shape=(q.shape[-1],),
                     device=q.device, contiguous=True)
    eps = qk_norm.eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"qk_norm.eps: expected a finite host float >= 0, got {eps!r}.")
    return float(eps), bool(qk_norm.plus_one)


@triton.jit
def head_inv_rms(x, eps, AXIS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """x: float32 head rows along ``AXIS`` (zeros past HEAD_DIM) -> 1 / sqrt(sum(x^2) / HEAD_DIM + eps) per
    row, with AXIS kept (size 1) for broadcasting."""
    return tl.rsqrt(tl.sum(x * x, axis=AXIS, keep_dims=True) / HEAD_DIM + eps)


@triton.jit
def qk_norm_value(x, inv_rms, w_ptr, dims, mask, PLUS_ONE: tl.constexpr):
    """Normed values of x (float32, at head dims ``dims``; ``inv_rms`` from ``head_inv_rms``) in float32:
    dtype(w' * dtype(x * inv_rms)), w' = w[dims] (+ 1 with PLUS_ONE), dtype = the weight's (the model's):
    the rounding steps of the engine's RMSNorm (``layer_ops.add_rms_norm``)."""
    dtype = w_ptr.dtype.element_ty
    n = (x * inv_rms).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + dims, mask=mask, other=0.0).to(tl.float32)
    if PLUS_ONE:
        w = w + 1.0
    return (w * n).to(dtype).to(tl.float32)


@triton.jit
def _norm_rotate_heads_(x_ptr, w_ptr, eps, tok, stride_tok, stride_head, c, s, d, d_ok,
                        NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                        HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PLUS_ONE: tl.constexpr):
    """``layer_ops._rotate_heads_`` on normed heads: every head of token ``tok`` normalized over its
    HEAD_DIM dims (``qk_norm_value``), then its first 2 * HALF dims rotated and stored in place (dims past
    2 * HALF are the caller's, ``_norm_tail_``).

    Returns the rotated halves ([HEADS_PAD, HALF_PAD], x's dtype), the head indices, the mask and the
    heads' 1 / rms ([HEADS_PAD, 1]). NOTE: every thread loads the whole rows for the mean square before
    any store, and the stores depend on it through the reduction, so no store overtakes a load of the
    same element; the halves are stored by the threads that loaded them (as ``_rotate_heads_``).
    """
    h = tl.arange(0, HEADS_PAD)
    row = x_ptr + tok * stride_tok + h[:, None] * stride_head
    dims = tl.arange(0, DIM_PAD)
    full = tl.load(row + dims[None, :], mask=(h[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM), other=0.0)
    inv_rms = head_inv_rms(full.to(tl.float32), eps, 1, HEAD_DIM)                     # [HEADS_PAD, 1]
    m = (h[:, None] < NUM_HEADS) & d_ok[None, :]
    x1 = tl.load(row + d[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + d[None, :], mask=m, other=0.0).to(tl.float32)
    x1 = qk_norm_value(x1, inv_rms, w_ptr, d[None, :], m, PLUS_ONE)
    x2 = qk_norm_value(x2, inv_rms, w_ptr, HALF + d[None, :], m, PLUS_ONE)
    r1 = (x1 * c - x2 * s).to(x_ptr.dtype.element_ty)
    r2 = (x2 * c + x1 * s).to(x_ptr.dtype.element_ty)
    tl.store(row + d[None, :], r1, mask=m)
    tl.store(row + HALF + d[None, :], r2, mask=m)
    return r1, r2, h, m, inv_rms


@triton.jit
def _norm_tail_(x_ptr, w_ptr, inv_rms, tok, stride_tok, stride_head, h, tail,
                NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PLUS_ONE: tl.constexpr):
    """Dims ``tail`` (past the rotary part) of every head of token ``tok`` normalized in place (each
    thread stores what it loaded); returns them ([HEADS_PAD, TAIL_PAD], float32) and their mask."""
    mt = (h[:, None] < NUM_HEADS) & (tail[None, :] < HEAD_DIM)
    off = x_ptr + tok * stride_tok + h[:, None] * stride_head + tail[None, :]
    xt = qk_norm_value(tl.load(off, mask=mt, other=0.0).to(tl.float32), inv_rms, w_ptr, tail[None, :], mt, PLUS_ONE)
    tl.store(off, xt.to(x_ptr.dtype.element_ty), mask=mt)
    return xt, mt


@triton.jit
def _rotary_write_kv_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                            cos_ptr, sin_ptr, positions_ptr, k_scale, v_scale, q_norm_ptr, k_norm_ptr, norm_eps,
                            stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                            stride_v_tok, stride_v_head, stride_c_blk, stride_c_slot, stride_c_head, stride_cs,
                            NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                            HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
                            KV_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
                            TAIL_PAD: tl.constexpr, QK_NORM: tl.constexpr = False,
                            NORM_PLUS_ONE: tl.constexpr = False):
    """Semantics, one program per token t (p = positions[t], c = cos[p, :HALF], s = sin[p, :HALF]):

        rot(x) = x with x[:HALF], x[HALF:2 * HALF] = x1 * c - x2 * s, x2 * c + x1 * s   (float32 math)
        if QK_NORM:                                 # per-head RMSNorm first (QKNormWeights; in place)
          q[t, h] = norm(q[t, h], q_norm) for every q head; k[t, h] = norm(k[t, h], k_norm) for every kv head
        q[t, h] = rot(q[t, h]) for every q head; k[t, h] = rot(k[t, h]) for every kv head (in place)
        slot = slot_mapping[t]
        if slot >= 0:
          k_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = k[t]     # rotated
          v_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = v[t]

    norm(x, w) = dtype(w' * dtype(x / sqrt(mean(x^2) + norm_eps))) over all HEAD_DIM dims, w' = w, or
    1 + w with NORM_PLUS_ONE (``qk_norm_value``). The rotation is ``layer_ops._rotate_heads_``, the same as
    the unfused rotary kernel's. An FP8 cache stores the rotated k (in k's dtype) and v quantized by
    ``cache_value``.
    """
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    c, s, d, d_ok = _rotary_cos_sin(cos_ptr, sin_ptr, positions_ptr, tok, stride_cs, HALF, HALF_PAD)
    if QK_NORM:
        _, _, hq, _, q_inv = _norm_rotate_heads_(q_ptr, q_norm_ptr, norm_eps, tok, stride_q_tok, stride_q_head,
                                                 c, s, d, d_ok, NUM_Q_HEADS, Q_HEADS_PAD, HALF, HEAD_DIM, DIM_PAD,
                                                 NORM_PLUS_ONE)
        r1, r2, hk, mk, k_inv = _norm_rotate_heads_(k_ptr, k_norm_ptr, norm_eps, tok, stride_k_tok, stride_k_head,
                                                    c, s, d, d_ok, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HEAD_DIM,
                                                    DIM_PAD, NORM_PLUS_ONE)
    else:
        _rotate_heads_(q_ptr, tok, stride_q_tok, stride_q_head, c, s, d, d_ok, NUM_Q_HEADS, Q_HEADS_PAD, HALF)
        r1, r2, hk, mk = _rotate_heads_(k_ptr, tok, stride_k_tok, stride_k_head, c, s, d, d_ok, NUM_KV_HEADS,
                                        KV_HEADS_PAD, HALF)
    if TAIL_PAD > 0:   # dims past the rotary part (partial rotary): not rotated (normed in place with QK_NORM)
        tail = 2 * HALF + tl.arange(0, TAIL_PAD)
        if QK_NORM:
            _norm_tail_(q_ptr, q_norm_ptr, q_inv, tok, stride_q_tok, stride_q_head, hq, tail, NUM_Q_HEADS,
                        HEAD_DIM, NORM_PLUS_ONE)
            kt, mt = _norm_tail_(k_ptr, k_norm_ptr, k_inv, tok, stride_k_tok, stride_k_head, hk, tail,
                                 NUM_KV_HEADS, HEAD_DIM, NORM_PLUS_ONE)
        else:
            mt = (hk[:, None] < NUM_KV_HEADS) & (tail[None, :] < HEAD_DIM)
            kt = tl.load(k_ptr + tok * stride_k_tok + hk[:, None] * stride_k_head + tail[None, :],
                         mask=mt).to(tl.float32)
    if slot >= 0:
        c_row = (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_slot
        offc = c_row + hk[:, None] * stride_c_head + d[None, :]
        tl.store(k_cache_ptr + offc, cache_value(r1.to(tl.float32), k_scale, k_cache_ptr), mask=mk)
        tl.store(k_cache_ptr + offc + HALF, cache_value(r2.to(tl.float32), k_scale, k_cache_ptr), mask=mk)
        if TAIL_PAD > 0:
            tl.store(k_cache_ptr + c_row + hk[:, None] * stride_c_head + tail[None, :],
                     cache_value(kt, k_scale, k_cache_ptr), mask=mt)
        dims = tl.arange(0, DIM_PAD)
        mv = (hk[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
        v = tl.load(v_ptr + tok * stride_v_tok + hk[:, None] * stride_v_head + dims[None, :], mask=mv)
        tl.store(v_cache_ptr + c_row + hk[:, None] * stride_c_head + dims[None, :],
                 cache_value(v.to(tl.float32), v_scale, v_cache_ptr), mask=mv)


def check_rotary_write_args(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> int:
    """Check ``rotary_write_kv``'s arguments (shared with ``kernels.lora_rotary_write_kv``); returns
    HALF = rotary_dim // 2."""
    half = check_rotary_args(positions, q, k, cos, sin, rotary_dim)
    num_tokens, _, head_dim = q.shape
    check_tensor("v", v, dtypes=(q.dtype,), shape=tuple(k.shape), device=q.device, last_dim_contiguous=True)
    _check_cache_args(k_cache, v_cache, slot_mapping, num_tokens, k.shape[1], head_dim, q.device)
    return half


def rotary_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor, *, k_scale: float = 1.0,
                    v_scale: float = 1.0, qk_norm: Optional[QKNormWeights] = None) -> None:
    """Rotate q and k in place (neox layout, first ``rotary_dim`` dims) and write the rotated k
    and v into the paged cache: ``layer_ops.rotary_embedding_`` then ``write_kv``, in one launch
    (with ``qk_norm``: each head of q and k RMS-normalized first, in the same launch).

    Args:
        positions: [num_tokens] int64 (or int32) absolute positions.
        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]; one
            dtype, last dims contiguous (views of a packed qkv output work).
        cos, sin: [max_position, >= rotary_dim / 2] float32 tables with one row stride.
        rotary_dim: even, <= head_dim.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, one dtype
            (float, or ``FP8_KV_DTYPE``).
        slot_mapping: [num_tokens] int64; < 0 skips the token's cache write (its q/k still rotate).
        k_scale, v_scale: an FP8 cache's per-tensor scales (``write_kv``); 1.0 for float caches.
        qk_norm: the per-head RMSNorm of q and k before rotary (``QKNormWeights``); q and k are left
            normalized and rotated. None: rotary only.
    """
    half = check_rotary_write_args(positions, q, k, v, cos, sin, rotary_dim, k_cache, v_cache, slot_mapping)
    k_scale, v_scale = check_kv_scales(k_cache.dtype, k_scale, v_scale)
    eps, plus_one = check_qk_norm(qk_norm, q) if qk_norm is not None else (0.0, False)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return
    tail = head_dim - 2 * half
    norm_weights = (qk_norm.q_weight, qk_norm.k_weight) if qk_norm is not None else (q, q)   # unused without
    _rotary_write_kv_kernel[(num_tokens,)](
        q, k, v, k_cache, v_cache, slot_mapping, cos, sin, positions, k_scale, v_scale, *norm_weights, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos.stride(0),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        BLOCK_SIZE=k_cache.shape[1], Q_HEADS_PAD=next_power_of_2(num_heads),
        KV_HEADS_PAD=next_power_of_2(num_kv_heads), HALF_PAD=max(2, next_power_of_2(half)),
        DIM_PAD=next_power_of_2(head_dim), TAIL_PAD=0 if tail == 0 else max(2, next_power_of_2(tail)),
        QK_NORM=qk_norm is not None, NORM_PLUS_ONE=plus_one, num_warps=4)
