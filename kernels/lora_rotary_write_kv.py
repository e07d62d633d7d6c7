"""The q/k/v LoRA expand fused into rotary + KV write (one launch instead of two per decode layer).

On the decode path the packed qkv projection's adapter update (``kernels.lora_expand``: a read-
modify-write of [T, q + 2 kv]) is followed by ``kernels.kv_write.rotary_write_kv``, which reads
q/k/v again, rotates q and k in place and writes k and v into the paged cache. This kernel does
both: each program adds its token's update to one head's columns in registers, then rotates and
writes as ``rotary_write_kv`` does. One launch fewer on every decoder layer's critical path.

Two launch shapes, programs over the q heads, then the kv heads (a kv program does k and v of
that head); base-model and padding tokens (slot < 0) read no B and get the plain rotary + write:

- *Per token* (steps of at most ``PER_TOKEN_MAX_TOKENS`` tokens, decode): one program per (token,
  head); the update is the expand's per-token multiply-add over the rank
  (``kernels.lora_expand._token_h`` / ``_token_delta``: each program loads its token's slot, its h
  and the [head_dim, rank] rows of B its head needs, from L2 after the adapter's first token).
- *Tiles* (larger steps: prefill, big decode batches): one program per (``block_m`` tokens of one
  adapter segment, head), as ``kernels.lora_expand_norm``'s tiles: the update is a [block_m, rank]
  x [rank, head_dim] dot, so each head's B rows are read once per tile.

Numerics, as the unfused pair (expand, then rotary_write_kv): x = dtype(x + delta) with delta
the expand's (h rounded through ``h_round_dtype``), then the rotation in float32 on that rounded x.

The torch twin is ``kernels.reference.lora_rotary_write_kv_ref``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

import triton
import triton.language as tl

from kernels.kv_write import check_rotary_write_args
from kernels.lora_expand import (_seg_or_base_tile, _tile_delta, _tile_h, _token_delta, _token_h, check_shrink_output,
                                 expand_upcast, h_round_dtype)
from kernels.lora_meta import LoRAKernelMeta
from kernels.lora_shrink import _check_meta
from kernels.utils import cdiv, check_tensor, is_interpreted, next_power_of_2

PER_TOKEN_MAX_TOKENS = 128
"""Steps of at most this many tokens take the per-token programs by default (every program streams
its head's B rows, which suits few tokens per adapter), larger ones the segment tiles."""

TILE_M = 32
"""Tokens per tile program on a GPU (16 under the interpreter)."""


@triton.jit
def _updated(x_row, cols, ok, b_ptr, slot, col0, n_out, rank, h, r_ok, BLOCK_R: tl.constexpr):
    """fp32 values of dtype(x[cols] + h @ B[slot][col0 + cols].T) (the expand's stored result)."""
    x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
    x += _token_delta(b_ptr, slot, col0 + cols, ok, n_out, rank, h, r_ok, BLOCK_R)
    return x.to(x_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _rotate_head(x_row, cache_row, write, b_ptr, slot, col0, n_out, rank, h, r_ok, c, s, d, d_ok,
                 HALF: tl.constexpr, HEAD_DIM: tl.constexpr, TAIL_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """One head: add the update, rotate the first 2 * HALF dims in place, and (where ``write``, an
    int32 0/1 vector over the HALF_PAD dims) store the result into the cache row too."""
    x1 = _updated(x_row, d, d_ok, b_ptr, slot, col0, n_out, rank, h, r_ok, BLOCK_R)
    x2 = _updated(x_row, HALF + d, d_ok, b_ptr, slot, col0, n_out, rank, h, r_ok, BLOCK_R)
    r1 = (x1 * c - x2 * s).to(x_row.dtype.element_ty)
    r2 = (x2 * c + x1 * s).to(x_row.dtype.element_ty)
    tl.store(x_row + d, r1, mask=d_ok)
    tl.store(x_row + HALF + d, r2, mask=d_ok)
    w_ok = d_ok & (write > 0)
    tl.store(cache_row + d, r1.to(tl.float32).to(cache_row.dtype.element_ty), mask=w_ok)
    tl.store(cache_row + HALF + d, r2.to(tl.float32).to(cache_row.dtype.element_ty), mask=w_ok)
    if TAIL_PAD > 0:   # dims past the rotary part (partial rotary): updated, not rotated
        tail = 2 * HALF + tl.arange(0, TAIL_PAD)
        t_ok = tail < HEAD_DIM
        xt = _updated(x_row, tail, t_ok, b_ptr, slot, col0, n_out, rank, h, r_ok, BLOCK_R)
        tl.store(x_row + tail, xt.to(x_row.dtype.element_ty), mask=t_ok)
        wt_ok = t_ok & (tl.zeros([TAIL_PAD], tl.int32) + tl.max(write, axis=0) > 0)
        tl.store(cache_row + tail, xt.to(x_row.dtype.element_ty).to(tl.float32).to(cache_row.dtype.element_ty),
                 mask=wt_ok)


@triton.jit
def _lora_rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, cos_ptr, sin_ptr, positions_ptr,
    buf_ptr, bq_ptr, bk_ptr, bv_ptr, token_lora_slots_ptr, rank,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_blk, stride_c_slot, stride_c_head, stride_cs,
    stride_buf_slice, stride_buf_split, stride_buf_tok, stride_buf_slot,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HALF_PAD: tl.constexpr, TAIL_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr, ROUND_TO: tl.constexpr,
):
    """Semantics (B_q, B_k, B_v: [max_loras, heads * HEAD_DIM, rank]; buf as ``lora_expand``'s):

        for t in range(num_tokens):
          if slot(t) >= 0:                                   # the expand, into q | k | v
            q[t] += rnd(h_q(t)) @ B_q[slot(t)].T ; k[t] += ... ; v[t] += ...     (stored in the dtype)
        then ``kv_write.rotary_write_kv`` on q, k, v (rotation in place, cache write where
        slot_mapping[t] >= 0)

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
    if j < NUM_Q_HEADS:
        h, r_ok = _token_h(buf_ptr, t, zero, lslot, rank, stride_buf_slice, stride_buf_split, stride_buf_tok,
                           stride_buf_slot, BLOCK_R, SPLIT_K, ROUND_TO)
        row = q_ptr + t * stride_q_tok + j * stride_q_head
        never = tl.zeros([HALF_PAD], tl.int32)
        _rotate_head(row, row, never, bq_ptr, lslot, j * HEAD_DIM, NUM_Q_HEADS * HEAD_DIM, rank, h, r_ok,
                     c, s, d, d_ok, HALF, HEAD_DIM, TAIL_PAD, BLOCK_R)
    else:
        kh = j - NUM_Q_HEADS
        n_kv = NUM_KV_HEADS * HEAD_DIM
        blk = tl.maximum(kv_slot, 0)
        c_row = (blk // BLOCK_SIZE) * stride_c_blk + (blk % BLOCK_SIZE) * stride_c_slot + kh * stride_c_head
        write = tl.zeros([HALF_PAD], tl.int32) + (kv_slot >= 0).to(tl.int32)
        h_k, r_ok = _token_h(buf_ptr, t, zero + 1, lslot, rank, stride_buf_slice, stride_buf_split,
                             stride_buf_tok, stride_buf_slot, BLOCK_R, SPLIT_K, ROUND_TO)
        _rotate_head(k_ptr + t * stride_k_tok + kh * stride_k_head, k_cache_ptr + c_row, write, bk_ptr, lslot,
                     kh * HEAD_DIM, n_kv, rank, h_k, r_ok, c, s, d, d_ok, HALF, HEAD_DIM, TAIL_PAD, BLOCK_R)
        h_v, _ = _token_h(buf_ptr, t, zero + 2, lslot, rank, stride_buf_slice, stride_buf_split,
                          stride_buf_tok, stride_buf_slot, BLOCK_R, SPLIT_K, ROUND_TO)
        dims = tl.arange(0, DIM_PAD)
        v_row = v_ptr + t * stride_v_tok + kh * stride_v_head
        dv_ok = dims < HEAD_DIM
        xv = _updated(v_row, dims, dv_ok, bv_ptr, lslot, kh * HEAD_DIM, n_kv, rank, h_v, r_ok, BLOCK_R)
        tl.store(v_row + dims, xv.to(v_row.dtype.element_ty), mask=dv_ok)
        wv_ok = dv_ok & (tl.zeros([DIM_PAD], tl.int32) + (kv_slot >= 0).to(tl.int32) > 0)
        tl.store(v_cache_ptr + c_row + dims, xv.to(v_cache_ptr.dtype.element_ty), mask=wv_ok)


@triton.jit
def _tile_updated(x_rows, cols, ok, m_ok, h, b_ptr, slot, flag, col0, n_out, rank, BLOCK_R: tl.constexpr,
                  UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """[BLOCK_M, len(cols)] fp32 values of dtype(x[:, cols] + h @ B[slot][col0 + cols].T) (the expand's
    stored result) for a tile's rows x_rows ([BLOCK_M, 1] pointers)."""
    x = tl.load(x_rows + cols[None, :], mask=m_ok[:, None] & ok[None, :], other=0.0).to(tl.float32)
    x += _tile_delta(h, b_ptr, slot, flag, col0 + cols, ok, n_out, rank, BLOCK_R, UPCAST, DOT_PRECISION)
    return x.to(x_rows.dtype.element_ty).to(tl.float32)


@triton.jit
def _tile_rotate_head(x_rows, cache_rows, write, m_ok, h, b_ptr, slot, flag, col0, n_out, rank, c, s, d, d_ok,
                      HALF: tl.constexpr, HEAD_DIM: tl.constexpr, TAIL_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                      UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``_rotate_head`` for a tile: one head of BLOCK_M rows (x_rows, cache_rows: [BLOCK_M, 1]
    pointers; write: [BLOCK_M] rows whose cache row is stored; c, s: [BLOCK_M, HALF_PAD])."""
    x1 = _tile_updated(x_rows, d, d_ok, m_ok, h, b_ptr, slot, flag, col0, n_out, rank, BLOCK_R, UPCAST, DOT_PRECISION)
    x2 = _tile_updated(x_rows, HALF + d, d_ok, m_ok, h, b_ptr, slot, flag, col0, n_out, rank, BLOCK_R, UPCAST,
                       DOT_PRECISION)
    r1 = (x1 * c - x2 * s).to(x_rows.dtype.element_ty)
    r2 = (x2 * c + x1 * s).to(x_rows.dtype.element_ty)
    mask = m_ok[:, None] & d_ok[None, :]
    tl.store(x_rows + d[None, :], r1, mask=mask)
    tl.store(x_rows + HALF + d[None, :], r2, mask=mask)
    w_mask = mask & write[:, None]
    tl.store(cache_rows + d[None, :], r1.to(tl.float32).to(cache_rows.dtype.element_ty), mask=w_mask)
    tl.store(cache_rows + HALF + d[None, :], r2.to(tl.float32).to(cache_rows.dtype.element_ty), mask=w_mask)
    if TAIL_PAD > 0:   # dims past the rotary part (partial rotary): updated, not rotated
        tail = 2 * HALF + tl.arange(0, TAIL_PAD)
        t_ok = tail < HEAD_DIM
        xt = _tile_updated(x_rows, tail, t_ok, m_ok, h, b_ptr, slot, flag, col0, n_out, rank, BLOCK_R, UPCAST,
                           DOT_PRECISION).to(x_rows.dtype.element_ty)
        t_mask = m_ok[:, None] & t_ok[None, :]
        tl.store(x_rows + tail[None, :], xt, mask=t_mask)
        tl.store(cache_rows + tail[None, :], xt.to(tl.float32).to(cache_rows.dtype.element_ty),
                 mask=t_mask & write[:, None])


@triton.jit(do_not_specialize=["num_active"])   # eager steps vary it: one binary for all
def _lora_rotary_write_kv_tile_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, cos_ptr, sin_ptr, positions_ptr,
    buf_ptr, bq_ptr, bk_ptr, bv_ptr, sorted_token_ids_ptr, active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr,
    num_tokens, num_active, rank,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_blk, stride_c_slot, stride_c_head, stride_cs,
    stride_buf_slice, stride_buf_split, stride_buf_tok, stride_buf_slot,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HALF_PAD: tl.constexpr, TAIL_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr, MAX_LORAS_PAD: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Semantics: as ``_lora_rotary_write_kv_kernel`` (the delta rounded as the expand's segment kernel
    rounds it). Program (m, j): token tile m of ``kernels.lora_expand._seg_or_base_tile``, q head j
    for j < NUM_Q_HEADS, else kv head j - NUM_Q_HEADS (k and v)."""
    j = tl.program_id(1)
    tok, m_ok, slot, flag, rows_left = _seg_or_base_tile(
        sorted_token_ids_ptr, active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr, tl.program_id(0),
        num_tokens, num_active, BLOCK_M, MAX_LORAS_PAD)
    if rows_left <= 0:
        return
    pos = tl.load(positions_ptr + tok, mask=m_ok, other=0).to(tl.int64)                # [BLOCK_M]
    d = tl.arange(0, HALF_PAD)
    d_ok = d < HALF
    cs_off = pos[:, None] * stride_cs + d[None, :]
    cs_mask = m_ok[:, None] & d_ok[None, :]
    c = tl.load(cos_ptr + cs_off, mask=cs_mask, other=0.0)                              # [BLOCK_M, HALF_PAD]
    s = tl.load(sin_ptr + cs_off, mask=cs_mask, other=0.0)
    zero = slot * 0
    if j < NUM_Q_HEADS:
        h = _tile_h(buf_ptr, zero, slot, flag, tok, m_ok, rank, stride_buf_slice, stride_buf_split, stride_buf_tok,
                    stride_buf_slot, BLOCK_M, BLOCK_R, SPLIT_K)
        if not UPCAST:
            h = h.to(bq_ptr.dtype.element_ty)
        rows = q_ptr + tok[:, None] * stride_q_tok + j * stride_q_head
        _tile_rotate_head(rows, rows, m_ok & (m_ok == 0), m_ok, h, bq_ptr, slot, flag, j * HEAD_DIM,
                          NUM_Q_HEADS * HEAD_DIM, rank, c, s, d, d_ok, HALF, HEAD_DIM, TAIL_PAD, BLOCK_R, UPCAST,
                          DOT_PRECISION)
    else:
        kh = j - NUM_Q_HEADS
        n_kv = NUM_KV_HEADS * HEAD_DIM
        kv_slot = tl.load(slot_mapping_ptr + tok, mask=m_ok, other=-1)                  # [BLOCK_M]
        blk = tl.maximum(kv_slot, 0)
        c_rows = ((blk // BLOCK_SIZE) * stride_c_blk + (blk % BLOCK_SIZE) * stride_c_slot
                  + kh * stride_c_head)[:, None]                                        # [BLOCK_M, 1]
        write = m_ok & (kv_slot >= 0)
        h_k = _tile_h(buf_ptr, zero + 1, slot, flag, tok, m_ok, rank, stride_buf_slice, stride_buf_split,
                      stride_buf_tok, stride_buf_slot, BLOCK_M, BLOCK_R, SPLIT_K)
        h_v = _tile_h(buf_ptr, zero + 2, slot, flag, tok, m_ok, rank, stride_buf_slice, stride_buf_split,
                      stride_buf_tok, stride_buf_slot, BLOCK_M, BLOCK_R, SPLIT_K)
        if not UPCAST:
            h_k = h_k.to(bk_ptr.dtype.element_ty)
            h_v = h_v.to(bv_ptr.dtype.element_ty)
        _tile_rotate_head(k_ptr + tok[:, None] * stride_k_tok + kh * stride_k_head, k_cache_ptr + c_rows, write,
                          m_ok, h_k, bk_ptr, slot, flag, kh * HEAD_DIM, n_kv, rank, c, s, d, d_ok, HALF, HEAD_DIM,
                          TAIL_PAD, BLOCK_R, UPCAST, DOT_PRECISION)
        dims = tl.arange(0, DIM_PAD)
        dv_ok = dims < HEAD_DIM
        v_rows = v_ptr + tok[:, None] * stride_v_tok + kh * stride_v_head
        xv = _tile_updated(v_rows, dims, dv_ok, m_ok, h_v, bv_ptr, slot, flag, kh * HEAD_DIM, n_kv, rank, BLOCK_R,
                           UPCAST, DOT_PRECISION).to(v_ptr.dtype.element_ty)
        v_mask = m_ok[:, None] & dv_ok[None, :]
        tl.store(v_rows + dims[None, :], xv, mask=v_mask)
        tl.store(v_cache_ptr + c_rows + dims[None, :], xv.to(tl.float32).to(v_cache_ptr.dtype.element_ty),
                 mask=v_mask & write[:, None])


def lora_rotary_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor, buf: torch.Tensor,
                         lora_b_slices: Sequence[torch.Tensor], meta: LoRAKernelMeta,
                         slot_stride: int = 0, *, tiles: Optional[bool] = None,
                         block_m: Optional[int] = None) -> None:
    """Add each LoRA token's q/k/v update into q, k, v, then ``kv_write.rotary_write_kv``: one launch.

    Args:
        positions, q, k, v, cos, sin, rotary_dim, k_cache, v_cache, slot_mapping: as
            ``kernels.kv_write.rotary_write_kv`` (q, k, v updated and rotated in place).
        buf: [3, split_k, num_tokens, rank], the shrink of the q, k and v slices, with
            ``slot_stride`` as in ``kernels.lora_expand.lora_expand``.
        lora_b_slices: (B_q, B_k, B_v): [max_loras, num_heads * head_dim, rank] and two
            [max_loras, num_kv_heads * head_dim, rank], q's dtype, contiguous.
        meta: this step's ``LoRAKernelMeta`` (token_lora_slots < 0: base model / padding).
        tiles: True: segment tiles; False: per-token programs; None: tiles above
            PER_TOKEN_MAX_TOKENS tokens.
        block_m: tokens per tile (a power of two >= 16); None: TILE_M (16 under the interpreter).
    """
    half = check_rotary_write_args(positions, q, k, v, cos, sin, rotary_dim, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    dev = q.device
    num_kv_heads = k.shape[1]
    split_k, rank = check_shrink_output(buf, 3, num_tokens, q, slot_stride)
    if not isinstance(lora_b_slices, (list, tuple)) or len(lora_b_slices) != 3:
        raise ValueError("lora_b_slices: expected (B_q, B_k, B_v).")
    max_loras = lora_b_slices[0].shape[0]
    for name, b, heads in zip(("B_q", "B_k", "B_v"), lora_b_slices, (num_heads, num_kv_heads, num_kv_heads)):
        check_tensor(name, b, dtypes=(q.dtype,), shape=(max_loras, heads * head_dim, rank), device=dev,
                     contiguous=True)
    _check_meta(meta, num_tokens, max_loras, dev)
    check_tensor("meta.token_lora_slots", meta.token_lora_slots, dtypes=(torch.int32,), shape=(num_tokens,),
                 device=dev, contiguous=True)
    if num_tokens == 0:
        return
    tail = head_dim - 2 * half
    block_r = max(16, next_power_of_2(rank))
    common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos.stride(0),
              buf.stride(0), buf.stride(1), buf.stride(2), slot_stride)
    if tiles is None:
        tiles = num_tokens > PER_TOKEN_MAX_TOKENS
    if not tiles:
        _lora_rotary_write_kv_kernel[(num_tokens, num_heads + num_kv_heads)](
            q, k, v, k_cache, v_cache, slot_mapping, cos, sin, positions,
            buf, *lora_b_slices, meta.token_lora_slots, rank, *common,
            NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
            BLOCK_SIZE=k_cache.shape[1], HALF_PAD=max(2, next_power_of_2(half)),
            TAIL_PAD=0 if tail == 0 else max(2, next_power_of_2(tail)), DIM_PAD=next_power_of_2(head_dim),
            BLOCK_R=block_r, SPLIT_K=split_k, ROUND_TO=h_round_dtype(q), num_warps=2)
        return
    num_active = 0 if meta.no_lora else meta.num_active
    if block_m is None:
        block_m = 16 if is_interpreted(dev) else TILE_M
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m: {block_m} must be a power of two >= 16.")
    # NOTE: every dot operand is >= 16 wide (tl.dot's smallest tile): pads of at least 16 dims.
    _lora_rotary_write_kv_tile_kernel[(num_tokens // block_m + num_active + cdiv(num_tokens, block_m),
                                       num_heads + num_kv_heads)](
        q, k, v, k_cache, v_cache, slot_mapping, cos, sin, positions,
        buf, *lora_b_slices, meta.sorted_token_ids, meta.active_slots, meta.num_tokens_per_slot, meta.slot_start,
        num_tokens, num_active, rank, *common,
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        BLOCK_SIZE=k_cache.shape[1], HALF_PAD=max(16, next_power_of_2(half)),
        TAIL_PAD=0 if tail == 0 else max(16, next_power_of_2(tail)), DIM_PAD=max(16, next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_R=block_r, SPLIT_K=split_k, MAX_LORAS_PAD=next_power_of_2(max_loras),
        UPCAST=expand_upcast(q), DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
