"""LoRA expand fused into the residual add + RMSNorm after o_proj and down_proj, one launch.

At decode, a projection whose output goes straight into add + RMSNorm (o_proj, and down_proj
into the next layer's input norm) would otherwise run the expand (``kernels.lora_expand``: one
launch on the critical path after the GEMM, a read-modify-write of its output) and then the norm
(``kernels.layer_ops.add_rms_norm``). This kernel does both per row: the row's adapter update
delta = h @ B[slot].T is added to the projection output in registers, then residual add and norm
as ``add_rms_norm``.

One program per row, two passes over the row in ``CHUNK`` columns: the first adds the delta and
the residual, stores the sum (into ``residual``, or into ``x`` without one) and accumulates the
sum of squares; the second reloads the sum (the program's own writes) and stores the normalized
row. Each row streams its adapter's B ([hidden, rank]) itself, which suits decode steps (tens to
hundreds of rows, B from L2 when rows share an adapter) and not prefill: ``lora.layers`` fuses
only steps of at most ``FUSE_NORM_MAX_TOKENS`` tokens.

Numerics, as the unfused pair (expand, then ``add_rms_norm``): h rounded to B's dtype on a GPU
with float16/bfloat16 (as the expand's native dot), the fp32 delta added to x and rounded to the
activation dtype, then add_rms_norm's roundings. The torch twin is
``kernels.reference.lora_expand_add_rms_norm_ref``.
"""

from __future__ import annotations

from typing import Optional

import torch

import triton
import triton.language as tl

from kernels.lora_expand import expand_upcast
from kernels.lora_meta import LoRAKernelMeta
from kernels.lora_shrink import _check_meta
from kernels.utils import FLOAT_DTYPES, check_tensor, next_power_of_2

FUSE_NORM_MAX_TOKENS = 256
"""``lora.layers`` fuses steps of at most this many tokens (each row reads its adapter's B: ~128 KB
at Llama-3-8B's hidden size). NOTE: measured at batch 64 only (benchmarks/RESULTS.md)."""


@triton.jit
def _lora_expand_add_rms_norm_kernel(
    buf_ptr, b_ptr, token_lora_slots_ptr, x_ptr, residual_ptr, weight_ptr, out_ptr,
    hidden, rank, eps,
    stride_buf_split, stride_buf_tok, stride_x, stride_r, stride_o,
    HAS_RESIDUAL: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Semantics, one program per row t (dtype = x's dtype, math in float32; B [max_loras, hidden, rank]):

        delta = (sum_j buf[0, j, t]) @ B[slot(t)].T if slot(t) >= 0 else 0
        p = dtype(x[t] + delta)
        if HAS_RESIDUAL:
            s = dtype(p + residual[t]); residual[t] = s          (in place)
        else:
            s = p; x[t] = s                                       (in place)
        out[t] = dtype(weight * dtype(s / sqrt(mean(s^2) + eps)))
    """
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_lora_slots_ptr + row)
    offs_r = tl.arange(0, BLOCK_R)
    # NOTE: the slot test broadcast to a vector mask (the interpreter rejects scalar-bool masks).
    r_ok = (offs_r < rank) & (tl.zeros([BLOCK_R], tl.int32) + slot >= 0)
    h = tl.zeros([BLOCK_R], dtype=tl.float32)
    for j in tl.static_range(SPLIT_K):
        h += tl.load(buf_ptr + j * stride_buf_split + row * stride_buf_tok + offs_r, mask=r_ok, other=0.0)
    if not UPCAST:
        h = h.to(b_ptr.dtype.element_ty).to(tl.float32)
    b_rows = b_ptr + tl.maximum(slot, 0).to(tl.int64) * hidden * rank + offs_r[None, :]     # [1, BLOCK_R]
    s_ptr = residual_ptr + row * stride_r if HAS_RESIDUAL else x_ptr + row * stride_x
    sq = tl.zeros([CHUNK], dtype=tl.float32)
    for c0 in range(0, hidden, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        ok = cols < hidden
        b = tl.load(b_rows + cols[:, None] * rank, mask=ok[:, None] & r_ok[None, :], other=0.0)  # [CHUNK, R]
        delta = tl.sum(b.to(tl.float32) * h[None, :], axis=1)                                   # [CHUNK]
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


def lora_expand_add_rms_norm(buf: torch.Tensor, lora_b: torch.Tensor, meta: LoRAKernelMeta, x: torch.Tensor,
                             weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None,
                             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm of (x + each LoRA row's update [+ residual]); the sum is stored into ``residual``
    (or into ``x`` without one), as ``kernels.layer_ops.add_rms_norm`` does.

    Args:
        buf: [1, split_k, num_tokens, rank] float32, contiguous: ``lora_shrink``'s partials.
        lora_b: [max_loras, hidden, rank] in x's dtype, contiguous.
        meta: this step's ``LoRAKernelMeta`` (its per-token slots are read).
        x: [num_tokens, hidden] the projection's base output, float16/bfloat16/float32, last dim
            contiguous.
        weight: [hidden], x's dtype. eps: added to the mean square.
        residual: optional [num_tokens, hidden] in x's dtype, last dim contiguous.
        out: optional [num_tokens, hidden] in x's dtype (may be x).

    Returns:
        out: the normalized rows.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, hidden = x.shape
    dev = x.device
    check_tensor("weight", weight, dtypes=(x.dtype,), shape=(hidden,), device=dev, contiguous=True)
    check_tensor("buf", buf, ndim=4, dtypes=(torch.float32,), device=dev, contiguous=True)
    split_k, rank = buf.shape[1], buf.shape[3]
    check_tensor("buf", buf, shape=(1, split_k, num_tokens, rank))
    if split_k < 1:
        raise ValueError("buf: split_k (dim 1) must be >= 1.")
    check_tensor("lora_b", lora_b, ndim=3, dtypes=(x.dtype,), shape=(None, hidden, rank), device=dev,
                 contiguous=True)
    _check_meta(meta, num_tokens, lora_b.shape[0], dev)
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), shape=(num_tokens, hidden), device=dev,
                     last_dim_contiguous=True)
    if out is None:
        out = torch.empty_like(x)                                                      # [T, hidden]
    check_tensor("out", out, dtypes=(x.dtype,), shape=(num_tokens, hidden), device=dev, last_dim_contiguous=True)
    if num_tokens == 0:
        return out
    chunk = min(1024, next_power_of_2(hidden))
    _lora_expand_add_rms_norm_kernel[(num_tokens,)](
        buf, lora_b, meta.token_lora_slots, x, residual if residual is not None else x, weight, out,
        hidden, rank, float(eps),
        buf.stride(1), buf.stride(2), x.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0),
        HAS_RESIDUAL=residual is not None, CHUNK=chunk, BLOCK_R=max(16, next_power_of_2(rank)), SPLIT_K=split_k,
        UPCAST=expand_upcast(x, lora_b), num_warps=4)
    return out
