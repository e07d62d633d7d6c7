"""The q/k/v LoRA expand fused into rotary + KV write (one launch instead of two per decode layer).

On the decode path the packed qkv projection's adapter update (``kernels.lora_expand``: a read-
modify-write of [T, q + 2 kv]) is followed by ``kernels.kv_write.rotary_write_kv``, which reads
q/k/v again, rotates q and k in place and writes k and v into the paged cache. This kernel does
both: each program adds its token's update to one head's columns in registers, then rotates and
writes as ``rotary_write_kv`` does. One launch fewer on every decoder layer's critical path.

Programs: one per (token, head) over the q heads, then the kv heads (a kv program does k and v
of that head); the update is the expand's per-token multiply-add over the rank
(``kernels.lora_expand._token_h`` / ``_token_delta``: each program loads its token's slot, its h
and the [head_dim, rank] rows of B its head needs). Base-model and padding tokens (slot < 0)
read no B and get the plain rotary + write.

Numerics, as the unfused pair (expand, then rotary_write_kv): x = dtype(x + delta) with delta
the expand's (h rounded through ``h_round_dtype``), then the rotation in float32 on that rounded x;
an FP8 cache stores the result quantized by ``kv_write.cache_value``.

The torch twin is ``kernels.reference.lora_rotary_write_kv_ref``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

import triton
import triton.language as tl

from kernels.kv_write import cache_value, check_kv_scales, check_rotary_write_args
from kernels.lora_expand import _token_delta, _token_h, check_shrink_output, h_round_dtype
from kernels.lora_pages import LoRASlotPages, padded_pages
from kernels.lora_shrink import _slot_rows
from kernels.utils import check_tensor, next_power_of_2

MAX_TOKENS = 128
"""Callers fuse at most this many tokens (decode steps; ``lora.layers``): every program streams
its head's B rows, from L2 after the first token of an adapter, which suits few tokens per adapter."""


@triton.jit
def _updated(x_row, cols, ok, b_ptr, page, sub, col0, n_out, h, r_ok, PAGE_ROWS: tl.constexpr):
    """fp32 values of dtype(x[cols] + h @ B_l[col0 + cols].T) (the expand's stored result; B_l the slot's
    rank rows: page, sub, r_ok from ``kernels.lora_shrink._slot_rows``)."""
    x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
    x += _token_delta(b_ptr, page, sub, col0 + cols, ok, n_out, h, r_ok, PAGE_ROWS)
    return x.to(x_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _rotate_head(x_row, cache_row, cache_scale, write, b_ptr, page, sub, col0, n_out, h, r_ok, c, s, d, d_ok,
                 HALF: tl.constexpr, HEAD_DIM: tl.constexpr, TAIL_PAD: tl.constexpr, PAGE_ROWS: tl.constexpr):
    """One head: add the update, rotate the first 2 * HALF dims in place, and (where ``write``, an
    int32 0/1 vector over the HALF_PAD dims) store the result into the cache row too (``cache_value``
    with ``cache_scale``)."""
    x1 = _updated(x_row, d, d_ok, b_ptr, page, sub, col0, n_out, h, r_ok, PAGE_ROWS)
    x2 = _updated(x_row, HALF + d, d_ok, b_ptr, page, sub, col0, n_out, h, r_ok, PAGE_ROWS)
    r1 = (x1 * c - x2 * s).to(x_row.dtype.element_ty)
    r2 = (x2 * c + x1 * s).to(x_row.dtype.element_ty)
    tl.store(x_row + d, r1, mask=d_ok)
    tl.store(x_row + HALF + d, r2, mask=d_ok)
    w_ok = d_ok & (write > 0)
    tl.store(cache_row + d, cache_value(r1.to(tl.float32), cache_scale, cache_row), mask=w_ok)
    tl.store(cache_row + HALF + d, cache_value(r2.to(tl.float32), cache_scale, cache_row), mask=w_ok)
    if TAIL_PAD > 0:   # dims past the rotary part (partial rotary): updated, not rotated
        tail = 2 * HALF + tl.arange(0, TAIL_PAD)
        t_ok = tail < HEAD_DIM
        xt = _updated(x_row, tail, t_ok, b_ptr, page, sub, col0, n_out, h, r_ok, PAGE_ROWS)
        tl.store(x_row + tail, xt.to(x_row.dtype.element_ty), mask=t_ok)
        wt_ok = t_ok & (tl.zeros([TAIL_PAD], tl.int32) + tl.max(write, axis=0) > 0)
        xt = xt.to(x_row.dtype.element_ty).to(tl.float32)
        tl.store(cache_row + tail, cache_value(xt, cache_scale, cache_row), mask=wt_ok)


@triton.jit
def _lora_rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, cos_ptr, sin_ptr, positions_ptr,
    k_scale, v_scale, buf_ptr, bq_ptr, bk_ptr, bv_ptr, token_lora_slots_ptr, page_table_ptr, slot_ranks_ptr,
    rank, max_pages,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_blk, stride_c_slot, stride_c_head, stride_cs,
    stride_buf_slice, stride_buf_split, stride_buf_tok, stride_buf_slot,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HALF_PAD: tl.constexpr, TAIL_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr, PAGE_ROWS: tl.constexpr,
    IDENTITY_PAGES: tl.constexpr, ROUND_TO: tl.constexpr,
):
    """Semantics (B_q, B_k, B_v: [num_pages, heads * HEAD_DIM, PAGE_ROWS], B[l] slot l's rank_l rows of
    its pages, ``kernels.lora_pages``; buf as ``lora_expand``'s, h its first rank_l columns):

        for t in range(num_tokens):
          if slot(t) >= 0:                                   # the expand, into q | k | v
            q[t] += rnd(h_q(t)) @ B_q[slot(t)].T ; k[t] += ... ; v[t] += ...     (stored in the dtype)
        then ``kv_write.rotary_write_kv`` on q, k, v (rotation in place, cache write where
        slot_mapping[t] >= 0; an FP8 cache quantized with k_scale / v_scale)

    Program (t, j): token t, q head j for j < NUM_Q_HEADS, else kv head j - NUM_Q_HEADS (k and v).
    """
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    lslot = tl.load(token_lora_slots_ptr + t)
    kv_slot = tl.load(slot_mapping_ptr + t)
    zero = lslot * 0
    pos = tl.load(positions_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    d_ok = d < HALF
    c = tl.load(cos_ptr + pos * stride_cs + d, mask=d_ok, other=0.0)
    s = tl.load(sin_ptr + pos * stride_cs + d, mask=d_ok, other=0.0)
    page, sub, r_ok = _slot_rows(page_table_ptr, slot_ranks_ptr, lslot, rank, max_pages, BLOCK_R, PAGE_ROWS,
                                 IDENTITY_PAGES)
    if j < NUM_Q_HEADS:
        h = _token_h(buf_ptr, t, zero, lslot, r_ok, stride_buf_slice, stride_buf_split, stride_buf_tok,
                     stride_buf_slot, BLOCK_R, SPLIT_K, ROUND_TO)
        row = q_ptr + t * stride_q_tok + j * stride_q_head
        never = tl.zeros([HALF_PAD], tl.int32)
        _rotate_head(row, row, 1.0, never, bq_ptr, page, sub, j * HEAD_DIM, NUM_Q_HEADS * HEAD_DIM, h, r_ok,
                     c, s, d, d_ok, HALF, HEAD_DIM, TAIL_PAD, PAGE_ROWS)
    else:
        kh = j - NUM_Q_HEADS
        n_kv = NUM_KV_HEADS * HEAD_DIM
        blk = tl.maximum(kv_slot, 0)
        c_row = (blk // BLOCK_SIZE) * stride_c_blk + (blk % BLOCK_SIZE) * stride_c_slot + kh * stride_c_head
        write = tl.zeros([HALF_PAD], tl.int32) + (kv_slot >= 0).to(tl.int32)
        h_k = _token_h(buf_ptr, t, zero + 1, lslot, r_ok, stride_buf_slice, stride_buf_split,
                       stride_buf_tok, stride_buf_slot, BLOCK_R, SPLIT_K, ROUND_TO)
        _rotate_head(k_ptr + t * stride_k_tok + kh * stride_k_head, k_cache_ptr + c_row, k_scale, write,
                     bk_ptr, page, sub, kh * HEAD_DIM, n_kv, h_k, r_ok, c, s, d, d_ok, HALF, HEAD_DIM,
                     TAIL_PAD, PAGE_ROWS)
        h_v = _token_h(buf_ptr, t, zero + 2, lslot, r_ok, stride_buf_slice, stride_buf_split,
                       stride_buf_tok, stride_buf_slot, BLOCK_R, SPLIT_K, ROUND_TO)
        dims = tl.arange(0, DIM_PAD)
        v_row = v_ptr + t * stride_v_tok + kh * stride_v_head
        dv_ok = dims < HEAD_DIM
        xv = _updated(v_row, dims, dv_ok, bv_ptr, page, sub, kh * HEAD_DIM, n_kv, h_v, r_ok, PAGE_ROWS)
        tl.store(v_row + dims, xv.to(v_row.dtype.element_ty), mask=dv_ok)
        wv_ok = dv_ok & (tl.zeros([DIM_PAD], tl.int32) + (kv_slot >= 0).to(tl.int32) > 0)
        tl.store(v_cache_ptr + c_row + dims, cache_value(xv, v_scale, v_cache_ptr), mask=wv_ok)


def lora_rotary_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor, buf: torch.Tensor,
                         lora_b_slices: Sequence[torch.Tensor], token_lora_slots: torch.Tensor,
                         slot_stride: int = 0, *, k_scale: float = 1.0, v_scale: float = 1.0,
                         num_warps: int = 2, pages: Optional[LoRASlotPages] = None) -> None:
    """Add each LoRA token's q/k/v update into q, k, v, then ``kv_write.rotary_write_kv``: one launch.

    Args:
        positions, q, k, v, cos, sin, rotary_dim, k_cache, v_cache, slot_mapping: as
            ``kernels.kv_write.rotary_write_kv`` (q, k, v updated and rotated in place).
        buf: [3, split_k, num_tokens, rank], the shrink of the q, k and v slices, with
            ``slot_stride`` as in ``kernels.lora_expand.lora_expand``.
        lora_b_slices: (B_q, B_k, B_v): [num_pages, num_heads * head_dim, page_rows] and two
            [num_pages, num_kv_heads * head_dim, page_rows] with ``pages`` (without: [max_loras, ..., max_rank],
            the padded layout), q's dtype, contiguous.
        token_lora_slots: [num_tokens] int32 slot per token (< 0: base model / padding).
        k_scale, v_scale: an FP8 cache's per-tensor scales (``kv_write.write_kv``); 1.0 for float caches.
        num_warps: per (token, head) program (benchmarks' sweeps).
        pages: the slots' page table (``kernels.lora_pages``); None: the padded layout.
    """
    half = check_rotary_write_args(positions, q, k, v, cos, sin, rotary_dim, k_cache, v_cache, slot_mapping)
    k_scale, v_scale = check_kv_scales(k_cache.dtype, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    dev = q.device
    num_kv_heads = k.shape[1]
    split_k, rank = check_shrink_output(buf, 3, num_tokens, q, slot_stride)
    if not isinstance(lora_b_slices, (list, tuple)) or len(lora_b_slices) != 3:
        raise ValueError("lora_b_slices: expected (B_q, B_k, B_v).")
    num_pages = lora_b_slices[0].shape[0]
    if pages is None:
        pages = padded_pages(num_pages, lora_b_slices[0].shape[2], dev)
    pages.check(pages.max_loras, dev)
    for name, b, heads in zip(("B_q", "B_k", "B_v"), lora_b_slices, (num_heads, num_kv_heads, num_kv_heads)):
        check_tensor(name, b, dtypes=(q.dtype,), shape=(num_pages, heads * head_dim, pages.page_rows), device=dev,
                     contiguous=True)
    check_tensor("token_lora_slots", token_lora_slots, dtypes=(torch.int32,), shape=(num_tokens,), device=dev,
                 contiguous=True)
    if num_tokens == 0:
        return
    tail = head_dim - 2 * half
    _lora_rotary_write_kv_kernel[(num_tokens, num_heads + num_kv_heads)](
        q, k, v, k_cache, v_cache, slot_mapping, cos, sin, positions, k_scale, v_scale,
        buf, *lora_b_slices, token_lora_slots, pages.page_table, pages.slot_ranks, rank, pages.max_pages,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos.stride(0),
        buf.stride(0), buf.stride(1), buf.stride(2), slot_stride,
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        BLOCK_SIZE=k_cache.shape[1], HALF_PAD=max(2, next_power_of_2(half)),
        TAIL_PAD=0 if tail == 0 else max(2, next_power_of_2(tail)), DIM_PAD=next_power_of_2(head_dim),
        BLOCK_R=max(16, next_power_of_2(rank)), SPLIT_K=split_k, PAGE_ROWS=pages.page_rows,
        IDENTITY_PAGES=pages.identity, ROUND_TO=h_round_dtype(q),
        num_warps=num_warps)
