"""LoRA expand fused into the residual add + RMSNorm after o_proj and down_proj (one launch).

At decode, a projection whose output goes straight into add + RMSNorm (o_proj into the
post-attention norm, down_proj into the next layer's input norm or the final norm) would
otherwise run the expand (``kernels.lora_expand``: one launch on the critical path after the GEMM,
a read-modify-write of its output) and then the norm (``kernels.layer_ops.add_rms_norm``). This
kernel does both per row: the row's update delta = h @ B[slot].T is added to the projection output
in registers, then the residual add and the norm, as ``add_rms_norm``.

One program per row, two passes over the row in ``CHUNK``-column pieces (one piece up to 4096
columns, so a Llama-3-8B row is one B load of [4096, rank] with every load in flight at once): the
first adds the delta and the residual, stores the sum (into ``residual``, or into ``x`` without
one) and accumulates the sum of squares; the second reloads the sum (the program's own stores, same
layout, so the same threads) and stores the normalized row. Each row streams its adapter's B
itself (from L2 when rows share an adapter), which suits decode steps: ``lora.layers`` fuses steps
of at most ``MAX_TOKENS`` tokens. (Spreading a row over (row, 1024-column) programs, the row's last
arrival normalizing it after an acq_rel counter, measured slower end to end on an H200: batch-64
decode 7.34 / 8.17 ms with 16 / 64 adapters against 7.28 / 8.02; see benchmarks/RESULTS.md.)

Numerics, as the unfused pair (expand, then ``add_rms_norm``): h rounded through
``h_round_dtype`` (B's dtype on a GPU's native path), the fp32 delta added to x and rounded to the
activation dtype, then add_rms_norm's roundings. The torch twin is
``kernels.reference.lora_expand_add_rms_norm_ref``.
"""

from __future__ import annotations

from typing import Optional

import torch

import triton
import triton.language as tl

from kernels.lora_expand import _token_delta, _token_h, check_shrink_output, h_round_dtype
from kernels.utils import FLOAT_DTYPES, check_tensor, next_power_of_2

MAX_TOKENS = 128
"""``lora.layers`` fuses steps of at most this many tokens (each row reads its adapter's B: 128 KB
at Llama-3-8B's hidden size)."""

MAX_CHUNK = 4096
"""Columns per piece: all of a row up to this width."""


@triton.jit
def _lora_expand_add_rms_norm_kernel(
    buf_ptr, b_ptr, token_lora_slots_ptr, x_ptr, residual_ptr, weight_ptr, out_ptr,
    hidden, rank, eps,
    stride_buf_split, stride_buf_tok, stride_buf_slot, stride_x, stride_r, stride_o,
    HAS_RESIDUAL: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
    ROUND_TO: tl.constexpr,
):
    """Semantics, one program per row t (dtype = x's dtype, math in float32; B [max_loras, hidden,
    rank]; buf as ``lora_expand``'s, one slice):

        delta = rnd(sum_j buf[0, j, t]) @ B[slot(t)].T if slot(t) >= 0 else 0
        p = dtype(x[t] + delta)
        if HAS_RESIDUAL:
            s = dtype(p + residual[t]); residual[t] = s          (in place)
        else:
            s = p; x[t] = s                                       (in place)
        out[t] = dtype(weight * dtype(s / sqrt(mean(s^2) + eps)))
    """
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_lora_slots_ptr + row)
    h, r_ok = _token_h(buf_ptr, row, slot * 0, slot, rank, 0, stride_buf_split, stride_buf_tok, stride_buf_slot,
                       BLOCK_R, SPLIT_K, ROUND_TO)
    s_ptr = residual_ptr + row * stride_r if HAS_RESIDUAL else x_ptr + row * stride_x
    sq = tl.zeros([CHUNK], dtype=tl.float32)
    for c0 in range(0, hidden, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        ok = cols < hidden
        delta = _token_delta(b_ptr, slot, cols, ok, hidden, rank, h, r_ok, BLOCK_R)          # [CHUNK] f32
        p = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        s = (p + delta).to(x_ptr.dtype.element_ty)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
            s = (s.to(tl.float32) + r).to(x_ptr.dtype.element_ty)
        tl.store(s_ptr + cols, s, mask=ok)
        s32 = s.to(tl.float32)
        sq += s32 * s32
    rstd = tl.rsqrt(tl.sum(sq, axis=0) / hidden + eps)
    for c0 in range(0, hidden, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        ok = cols < hidden
        s = tl.load(s_ptr + cols, mask=ok, other=0.0).to(tl.float32)        # this program's own stores
        n = (s * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (w * n).to(out_ptr.dtype.element_ty), mask=ok)


def lora_expand_add_rms_norm(buf: torch.Tensor, lora_b: torch.Tensor, token_lora_slots: torch.Tensor,
                             x: torch.Tensor, weight: torch.Tensor, eps: float,
                             residual: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                             slot_stride: int = 0) -> torch.Tensor:
    """RMSNorm of (x + each LoRA row's update [+ residual]); the sum is stored into ``residual``
    (or into ``x`` without one), as ``kernels.layer_ops.add_rms_norm`` does.

    Args:
        buf: [1, split_k, num_tokens, rank]: ``lora_shrink``'s float32 partials, or every slot's
            shrink with slot_stride > 0 (see ``kernels.lora_expand.lora_expand``).
        lora_b: [max_loras, hidden, rank] in x's dtype, contiguous.
        token_lora_slots: [num_tokens] int32 slot per row (< 0: base model / padding, no update).
        x: [num_tokens, hidden] the projection's base output, float16/bfloat16/float32, last dim
            contiguous.
        weight: [hidden], x's dtype. eps: added to the mean square.
        residual: optional [num_tokens, hidden] in x's dtype, last dim contiguous.
        out: optional [num_tokens, hidden] in x's dtype (may be x).
        slot_stride: see buf.

    Returns:
        out: the normalized rows.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, hidden = x.shape
    dev = x.device
    check_tensor("weight", weight, dtypes=(x.dtype,), shape=(hidden,), device=dev, contiguous=True)
    split_k, rank = check_shrink_output(buf, 1, num_tokens, x, slot_stride)
    check_tensor("lora_b", lora_b, ndim=3, dtypes=(x.dtype,), shape=(None, hidden, rank), device=dev,
                 contiguous=True)
    check_tensor("token_lora_slots", token_lora_slots, dtypes=(torch.int32,), shape=(num_tokens,), device=dev,
                 contiguous=True)
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), shape=(num_tokens, hidden), device=dev,
                     last_dim_contiguous=True)
    if out is None:
        out = torch.empty_like(x)                                                      # [T, hidden]
    check_tensor("out", out, dtypes=(x.dtype,), shape=(num_tokens, hidden), device=dev, last_dim_contiguous=True)
    if num_tokens == 0:
        return out
    chunk = min(MAX_CHUNK, next_power_of_2(hidden))
    _lora_expand_add_rms_norm_kernel[(num_tokens,)](
        buf, lora_b, token_lora_slots, x, residual if residual is not None else x, weight, out,
        hidden, rank, float(eps),
        buf.stride(1), buf.stride(2), slot_stride, x.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0),
        HAS_RESIDUAL=residual is not None, CHUNK=chunk, BLOCK_R=max(16, next_power_of_2(rank)), SPLIT_K=split_k,
        ROUND_TO=h_round_dtype(x), num_warps=16 if chunk >= 4096 else max(1, chunk // 256))
    return out
