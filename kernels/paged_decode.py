"""Paged attention for pure-decode batches (one query token per request): one Triton kernel.

Why a kernel of its own: at large decode batches ``kernels.paged_attention`` streams the KV cache
near the GPU's read bandwidth but pays a fixed cost per wave of programs: the chain of dependent
loads each program waits for before its first KV tile (its request from ``query_start_loc``, the
request's rows, ``seq_lens``, the block table, then K/V). Fitted over context lengths on an H200
(Llama-3-8B heads, batch 256), the call's time is that fixed cost per wave plus a slope at the KV
read bandwidth, and at typical decode contexts the fixed part is a noticeable share of the call.

This kernel cuts the chain:
  * the batch is pure decode (token i is request i), so a program knows its request and query
    row from its grid position: no ``query_start_loc`` loads;
  * optionally one program runs ``HEADS_PER_PROG`` KV heads of one request in a single loop over
    (head, tile) pairs, so the chain is paid once per program. Measured on an H200 (batch 256,
    534-token contexts) more heads per program were slower (``benchmarks/RESULTS.md``, "Launch configs
    and constants inside the kernels"), so the default is 1
    (``kernels.paged_attention.DEFAULT_HEADS_PER_PROG``).

Two options for one head per program (``kernels.paged_attention.paged_decode_rotary``, the
engine's path for small decode batches, ``decode_rotary_pays``):
  * ROTARY: the step's rotary + KV write fused in: q and the new k are rotated in registers, the
    new k and v are stored at the token's slot, and the newest key is folded in from registers
    (no read-after-write through memory), so a layer's decode is one launch instead of two; with
    QK_NORM each head of q and of k is first RMS-normalized in registers (Qwen3's and Gemma 3's q/k
    norms, ``kv_write.QKNormWeights``), so those norms cost no launch either;
  * NUM_SPLITS > 1 (split-KV): each program covers a segment of the key tiles and writes
    partials for ``paged_attention._merge_splits_kernel``.

Grid: (num_kv_heads / HEADS_PER_PROG, num_reqs, num_splits); KV-head groups on axis 0, so one
request's programs run together and read neighbouring rows of the [block, slot, kv_head, dim]
cache. Hardware scheduling of programs keeps the balance when contexts differ.

FP8 caches are read as ``kernels.paged_attention`` reads them (``kernels.attention_tile``).

The torch twin is ``kernels.reference.paged_attention_ref`` (the same semantics as the general
kernel restricted to one query token per request; on the dequantized caches for FP8).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

import triton
import triton.language as tl

from kernels.attention_tile import (NO_WINDOW, load_kv_tile, online_softmax_step, scale_values,
                                    score_scale_log2, store_partials, window_tiles)
from kernels.kv_write import QKNormWeights, cache_value, head_inv_rms, qk_norm_value
from kernels.utils import is_interpreted

MAX_DECODE_REQS = 65535
"""Grid axis 1 holds the requests (CUDA allows < 2**16 there); larger batches take the general kernel."""


@triton.jit
def _neox_rotate(x_ptr, offs, partner_offs, mask, cos_f, sin_f, sign, norm_ptr, norm_eps,
                 AXIS: tl.constexpr, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr, NORM_PLUS_ONE: tl.constexpr):
    """Load x at ``offs`` (head dims ``offs`` from ``x_ptr``, rows along ``AXIS``) and rotate it (neox /
    rotate-half) in float32: x * cos + sign * x[partner] * sin, where for dims d < HALF the partner is
    d + HALF (sign -1), for HALF <= d < 2 * HALF it is d - HALF (sign +1), and dims past 2 * HALF
    (partial rotary) keep x (cos 1, sin 0): the same products as ``layer_ops._rotate_heads_``. With
    QK_NORM, x and its partner are first normed by the row's 1 / rms and the weights at ``norm_ptr``
    (``kv_write.qk_norm_value``, as ``kv_write.rotary_write_kv`` norms them)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + partner_offs, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        inv_rms = head_inv_rms(x, norm_eps, AXIS, HEAD_DIM)
        x = qk_norm_value(x, inv_rms, norm_ptr, offs, mask, NORM_PLUS_ONE)
        xp = qk_norm_value(xp, inv_rms, norm_ptr, partner_offs, mask, NORM_PLUS_ONE)
    return x * cos_f + (sign * xp) * sin_f


@triton.jit
def _attend_keys(q, k_cache_ptr, v_cache_ptr, bt_row, kpos, k_ok, kv_head, dims, dim_ok,
                 stride_c_blk, stride_c_slot, stride_c_head, m_i, l_i, acc, qk_scale_log2,
                 BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold the cached keys ``kpos`` (those with ``k_ok``; one query token sees all of them) of KV
    head ``kv_head`` into the running softmax state: ``load_kv_tile`` + ``online_softmax_step``."""
    k_t, v = load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, kpos, k_ok, kv_head, dims, dim_ok,
                          stride_c_blk, stride_c_slot, stride_c_head, BLOCK_SIZE, q.dtype)
    return online_softmax_step(q, k_t, v, k_ok[None, :], m_i, l_i, acc, qk_scale_log2, DOT_PRECISION)


@triton.jit(do_not_specialize=["window"])   # one binary for windowed and full layers
def _paged_decode_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, seq_lens_ptr, block_tables_ptr, qk_scale_log2, k_scale, v_scale,
    num_heads, window,
    k_new_ptr, v_new_ptr, slot_mapping_ptr, positions_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, norm_eps,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_blk, stride_c_slot, stride_c_head, stride_bt_req,
    stride_kn_tok, stride_kn_head, stride_vn_tok, stride_vn_head, stride_cs,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_M: tl.constexpr, HEADS_PER_PROG: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_SPLITS: tl.constexpr = 1,
    ROTARY: tl.constexpr = False, HALF: tl.constexpr = 1, QK_NORM: tl.constexpr = False,
    NORM_PLUS_ONE: tl.constexpr = False,
):
    """Semantics (scores in log2 units, qk_scale_log2 = scale * log2(e)): for request r (query
    token r) and each query head h of KV heads [g * HEADS_PER_PROG, (g + 1) * HEADS_PER_PROG),
    kvh = h // GROUP, keys p = max(0, seq_lens[r] - window) .. seq_lens[r] - 1 (``window``: the sliding
    window, ``NO_WINDOW`` for none; earlier keys are never read),
    K[p] = k_cache[block_tables[r, p // BLOCK_SIZE], p % BLOCK_SIZE, kvh]:

        s[p] = q[r, h] . K[p] * qk_scale_log2
        out[r, h] = sum_p 2^(s[p] - max s) V[p] / sum_p 2^(s[p] - max s)   (fp32, stored in out's dtype)

    A request with seq_lens[r] == 0 gets zeros. An FP8 cache: K[p] and V[p] are the stored values
    times k_scale and v_scale (k_scale is also inside qk_scale_log2; ``kernels.attention_tile``).

    ROTARY (HEADS_PER_PROG == 1): the step's rotary + KV write fused in. q, k_new and v_new hold
    the token's projections before rotary; with c = cos[positions[r]], s = sin[positions[r]] (the
    first HALF columns; neox layout, dims past 2 * HALF unrotated) the kernel uses
    q[r, h] = dtype(rot(q[r, h])) and, for the newest key p = seq_lens[r] - 1,
    K[p] = dtype(rot(k_new[r, kvh])), V[p] = v_new[r, kvh] from registers, and stores those two at
    slot_mapping[r] (skipped when < 0): the same values ``kv_write.rotary_write_kv`` writes (for an
    FP8 cache quantized by ``kv_write.cache_value``, and attended as stored), so later steps read
    them from the cache. q itself is not written back. QK_NORM (with ROTARY): q[r, h] and k_new[r, kvh]
    are RMS-normalized per head before the rotation, as ``kv_write.rotary_write_kv``'s QK_NORM
    (weights at q_norm_ptr / k_norm_ptr, ``norm_eps``, 1 + w with NORM_PLUS_ONE).

    NUM_SPLITS > 1 (HEADS_PER_PROG == 1; grid axis 2 = segment): program (g, r, seg) covers only
    its segment of the key tiles and stores acc = sum_p 2^(s[p] - m) V[p], m = max s,
    l = sum_p 2^(s[p] - m) into the partials [num_reqs, num_heads, NUM_SPLITS, (HEAD_PAD)], merged
    by ``paged_attention._merge_splits_kernel``. With ROTARY the segment holding the newest key
    folds it in and writes the cache.
    """
    kvh0 = tl.program_id(0) * HEADS_PER_PROG
    req = tl.program_id(1)
    seg = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    num_tiles = tl.maximum(tl.cdiv(seq_len, TILE_N), 1)
    key_lo = tl.maximum(seq_len - window, 0)                        # the query's first key
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    if ROTARY:
        pos = tl.load(positions_ptr + req).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + req)
        rot_ok = dims < 2 * HALF
        cos_f = tl.load(cos_ptr + pos * stride_cs + dims % HALF, mask=rot_ok, other=1.0)    # [HEAD_PAD]
        sin_f = tl.load(sin_ptr + pos * stride_cs + dims % HALF, mask=rot_ok, other=0.0)
        sign = tl.where(dims < HALF, -1.0, 1.0)
        partner = tl.where(dims < HALF, dims + HALF, tl.where(rot_ok, dims - HALF, dims))

    rows = tl.arange(0, BLOCK_M)                                    # query heads of one KV head
    row_ok = rows < GROUP
    tok = req.to(tl.int64)
    q_row = q_ptr + tok * stride_q_tok + dims[None, :]
    o_row = out_ptr + tok * stride_o_tok + dims[None, :]
    io_mask = row_ok[:, None] & dim_ok[None, :]
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt_req
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    if HEADS_PER_PROG == 1:
        head = kvh0 * GROUP + rows                                  # [BLOCK_M]
        if ROTARY:
            q_base = q_ptr + tok * stride_q_tok + head[:, None] * stride_q_head
            q = _neox_rotate(q_base, dims[None, :], partner[None, :], io_mask, cos_f[None, :], sin_f[None, :],
                             sign[None, :], q_norm_ptr, norm_eps, 1, HEAD_DIM, QK_NORM,
                             NORM_PLUS_ONE).to(q_ptr.dtype.element_ty)
        else:
            q = tl.load(q_row + head[:, None] * stride_q_head, mask=io_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        tile_lo, tile_hi = window_tiles(key_lo, num_tiles, seg, TILE_N, NUM_SPLITS)
        cache_end = seq_len - 1 if ROTARY else seq_len              # ROTARY: the newest key from registers
        for tile in range(tile_lo, tile_hi):
            kpos = tile * TILE_N + tl.arange(0, TILE_N)                 # [TILE_N]
            k_ok = (kpos < cache_end) & (kpos >= key_lo)
            m_i, l_i, acc = _attend_keys(q, k_cache_ptr, v_cache_ptr, bt_row, kpos, k_ok, kvh0, dims, dim_ok,
                                         stride_c_blk, stride_c_slot, stride_c_head, m_i, l_i, acc, qk_scale_log2,
                                         BLOCK_SIZE, DOT_PRECISION)
        if ROTARY:
            if (seq_len > 0) & (tile_lo <= num_tiles - 1) & (num_tiles - 1 < tile_hi):
                kn_base = k_new_ptr + tok * stride_kn_tok + kvh0 * stride_kn_head
                k_new = _neox_rotate(kn_base, dims, partner, dim_ok, cos_f, sin_f, sign, k_norm_ptr, norm_eps, 0,
                                     HEAD_DIM, QK_NORM, NORM_PLUS_ONE)
                k_new = cache_value(k_new.to(k_new_ptr.dtype.element_ty).to(tl.float32), k_scale, k_cache_ptr)
                v_new = tl.load(v_new_ptr + tok * stride_vn_tok + kvh0 * stride_vn_head + dims, mask=dim_ok,
                                other=0.0)
                v_new = cache_value(v_new.to(tl.float32), v_scale, v_cache_ptr)
                if slot >= 0:
                    c_off = (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_slot \
                        + kvh0 * stride_c_head + dims
                    tl.store(k_cache_ptr + c_off, k_new, mask=dim_ok)
                    tl.store(v_cache_ptr + c_off, v_new, mask=dim_ok)
                # The newest key as a 16-column tile whose column 0 alone is visible (tl.dot's minimum),
                # its values as stored (as ``load_kv_tile`` reads them).
                col = tl.arange(0, 16)
                k_t = tl.where(col[None, :] == 0, k_new.to(tl.float32)[:, None], 0.0).to(q.dtype)
                v = tl.where(col[:, None] == 0, v_new.to(tl.float32)[None, :], 0.0).to(q.dtype)
                m_i, l_i, acc = online_softmax_step(q, k_t, v, (col == 0)[None, :], m_i, l_i, acc, qk_scale_log2,
                                                    DOT_PRECISION)
        acc = scale_values(acc, v_scale, v_cache_ptr)
        if NUM_SPLITS == 1:
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(o_row + head[:, None] * stride_o_head, o.to(out_ptr.dtype.element_ty), mask=io_mask)
        else:
            part = (tok * num_heads + head) * NUM_SPLITS + seg                 # [BLOCK_M]
            store_partials(part_acc_ptr, part_max_ptr, part_sum_ptr, part, m_i, l_i, acc, row_ok, dims, HEAD_PAD)
    else:
        tile0 = key_lo // TILE_N
        win_tiles = num_tiles - tile0                                       # tiles of the window
        for it in range(0, HEADS_PER_PROG * win_tiles):
            h_local = it // win_tiles
            tile = tile0 + it - h_local * win_tiles
            kv_head = kvh0 + h_local
            head = kv_head * GROUP + rows                                   # [BLOCK_M]
            q = tl.load(q_row + head[:, None] * stride_q_head, mask=io_mask, other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
            kpos = tile * TILE_N + tl.arange(0, TILE_N)                     # [TILE_N]
            k_ok = (kpos < seq_len) & (kpos >= key_lo)
            m_i, l_i, acc = _attend_keys(q, k_cache_ptr, v_cache_ptr, bt_row, kpos, k_ok, kv_head, dims, dim_ok,
                                         stride_c_blk, stride_c_slot, stride_c_head, m_i, l_i, acc, qk_scale_log2,
                                         BLOCK_SIZE, DOT_PRECISION)
            # The head's last tile: store it and start the next head from scratch (branch-free,
            # so the loop stays one software-pipelined loop).
            last = tile == num_tiles - 1
            o = scale_values(acc, v_scale, v_cache_ptr) / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            # NOTE: the test is broadcast over rows before the & (a scalar bool & a vector gives
            # ints under TRITON_INTERPRET=1, which tl.store rejects as a mask).
            store_ok = (row_ok & ((rows * 0 + tile) == num_tiles - 1))[:, None] & dim_ok[None, :]
            tl.store(o_row + head[:, None] * stride_o_head, o.to(out_ptr.dtype.element_ty), mask=store_ok)
            m_i = tl.where(last, float("-inf"), m_i)
            l_i = tl.where(last, 0.0, l_i)
            acc = tl.where(last, 0.0, acc)


class DecodeRotary(NamedTuple):
    """The step's rotary + KV write, fused into the pure-decode kernel (``ROTARY``): q passed
    with it is taken before rotary."""

    k: torch.Tensor                 # [num_reqs, num_kv_heads, head_dim], before rotary (last dim contiguous)
    v: torch.Tensor                 # [num_reqs, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor      # [num_reqs] int64 cache slot of each request's token (< 0: no write)
    positions: torch.Tensor         # [num_reqs] int64 / int32
    cos: torch.Tensor               # [max_position, >= half] float32
    sin: torch.Tensor               # like cos, same row stride
    half: int                       # rotary_dim // 2
    qk_norm: Optional[QKNormWeights] = None   # per-head RMSNorm of q and k before rotary (checked); None: none


def launch_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, scale: float, out: torch.Tensor, *, block_m: int, head_pad: int,
                        tile_n: int, heads_per_prog: int, num_warps: int, num_stages: int, num_splits: int = 1,
                        partials: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                        rotary: Optional[DecodeRotary] = None,
                        kv_scales: tuple[float, float] = (1.0, 1.0), window: Optional[int] = None) -> None:
    """One launch over a pure-decode batch (q row i is request i's only token). The caller
    (``kernels.paged_attention``) has checked the inputs and picked the tiles; ``heads_per_prog``
    must divide num_kv_heads and num_reqs be <= ``MAX_DECODE_REQS``. ``num_splits > 1`` writes
    ``partials`` (acc [num_reqs, num_heads, num_splits, head_pad], max and sum [num_reqs,
    num_heads, num_splits], float32) for the caller's merge; split-KV and ``rotary`` need
    ``heads_per_prog == 1``. ``kv_scales``: an FP8 cache's checked (k_scale, v_scale); ``window``: the
    layer's sliding window (None: none)."""
    num_reqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_kv_heads % heads_per_prog or num_reqs > MAX_DECODE_REQS or q.shape[0] != num_reqs:
        raise ValueError(f"paged decode: heads_per_prog {heads_per_prog} must divide {num_kv_heads} KV heads, "
                         f"and {q.shape[0]} query rows must be the {num_reqs} requests (<= {MAX_DECODE_REQS}).")
    if (num_splits > 1 or rotary is not None) and heads_per_prog != 1:
        raise ValueError(f"paged decode: split-KV and the fused rotary need heads_per_prog 1, got {heads_per_prog}.")
    if (num_splits > 1) != (partials is not None):
        raise ValueError("paged decode: pass partials exactly when num_splits > 1.")
    upcast = is_interpreted(q.device) or q.dtype == torch.float32
    part_acc, part_max, part_sum = partials if partials is not None else (out, out, out)   # unused at 1 split
    r = rotary
    rot_args = ((r.k, r.v, r.slot_mapping, r.positions, r.cos, r.sin) if r is not None
                else (q, q, seq_lens, seq_lens, q, q))                                        # unused without
    norm = r.qk_norm if r is not None else None
    norm_args = (norm.q_weight, norm.k_weight, float(norm.eps)) if norm is not None else (q, q, 0.0)
    rot_strides = ((r.k.stride(0), r.k.stride(1), r.v.stride(0), r.v.stride(1), r.cos.stride(0)) if r is not None
                   else (0, 0, 0, 0, 0))
    grid = (num_kv_heads // heads_per_prog, num_reqs, num_splits)
    _paged_decode_kernel[grid](
        out, part_acc, part_max, part_sum,
        q, k_cache, v_cache, seq_lens, block_tables, score_scale_log2(scale, kv_scales[0], k_cache.dtype),
        kv_scales[0], kv_scales[1], num_heads, NO_WINDOW if window is None else window,
        *rot_args, *norm_args,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        *rot_strides,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
        TILE_N=tile_n, BLOCK_M=block_m, HEADS_PER_PROG=heads_per_prog, UPCAST=upcast,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", NUM_SPLITS=num_splits,
        ROTARY=r is not None, HALF=r.half if r is not None else 1, QK_NORM=norm is not None,
        NORM_PLUS_ONE=norm is not None and bool(norm.plus_one), num_warps=num_warps, num_stages=num_stages,
    )
