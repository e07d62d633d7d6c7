"""LoRA expand fused into the residual add + RMSNorm after o_proj and down_proj (one launch).

At decode, a projection whose output goes straight into add + RMSNorm (o_proj into the
post-attention norm, down_proj into the next layer's input norm or the final norm) would
otherwise run the expand (``kernels.lora_expand``: one launch on the critical path after the GEMM,
a read-modify-write of its output) and then the norm (``kernels.layer_ops.add_rms_norm``). This
kernel does both per row: the row's update delta = h @ B[slot].T is added to the projection output
in registers, then the residual add and the norm, as ``add_rms_norm``.

Two launch shapes, both two passes over each row (the first adds the delta and the residual,
stores the sum (into ``residual``, or into ``x`` without one) and accumulates the sum of squares;
the second reloads the sum and stores the normalized row):

- *Per row* (steps of at most ``PER_ROW_MAX_TOKENS`` tokens: decode): one program per row, in
  ``CHUNK``-column pieces (one piece up to 4096 columns, so a Llama-3-8B row is one B load of
  [4096, rank] with every load in flight at once, 16 warps); the update is a multiply-add over
  the rank. Each row streams its adapter's B itself (from L2 when rows share an adapter).
  (Spreading a row over (row, 1024-column) programs, the row's last arrival normalizing it after
  an acq_rel counter, measured slower end to end in batch-64 decode on an H200, with 16 and 64
  adapters.)
- *Tiles* (larger steps; ``lora.layers`` fuses from ``TILES_MIN_TOKENS`` rows on: long prefill
  steps): one program per ``block_m`` rows of one adapter segment (``LoRAKernelMeta``; the
  base-model rows get tiles of their own, as in ``kernels.lora_expand_silu_mul``), walking
  ``block_n``-column pieces: the delta is a [block_m, rank] x [rank, block_n] dot, so B is read
  once per tile, not once per row.

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

from kernels.lora_expand import (_seg_or_base_tile, _tile_delta, _tile_h, _token_delta, _token_h, check_shrink_output,
                                 expand_upcast, h_round_dtype, slice_pages)
from kernels.lora_meta import LoRAKernelMeta
from kernels.lora_pages import LoRASlotPages
from kernels.lora_shrink import _check_meta, _slot_rows, tile_m_for
from kernels.utils import FLOAT_DTYPES, cdiv, check_tensor, is_interpreted, next_power_of_2

PER_ROW_MAX_TOKENS = 128
"""Steps of at most this many tokens take the per-row programs (each row reads its adapter's B:
128 KB at Llama-3-8B's hidden size), larger ones the segment tiles."""

TILES_MIN_TOKENS = 4097
"""``lora.layers`` fuses steps of at most PER_ROW_MAX_TOKENS or at least this many tokens and
leaves the sizes between to the expand + ``add_rms_norm`` pair. Measured per call on an H200
(Llama-3-8B hidden, 16 adapters, ``benchmarks/sweeps/lora_prefill_sweep.py --fused-consumers``):
the fused kernel, in its best shape, loses to the pair from 512 to 2048 rows, is level at 4096
and ahead above (long prefill steps: ``benchmarks/RESULTS.md``, ``lora_fuse_norm``). At 256 rows
it is ahead per call, but end to end the per-row launch there made batch-256 decode slower, hence
PER_ROW_MAX_TOKENS 128."""


MAX_CHUNK = 4096
"""Columns per piece of a per-row program: all of a row up to this width."""

ROW_TILE_ELEMS = 65536
"""The per-row programs load a [chunk, BLOCK_R] piece of B at once: at most this many elements
(rank 16: a 4096-column piece, as measured on the H200), one warp per 4096 of them (``row_launch``)."""


def row_launch(hidden: int, block_r: int) -> tuple[int, int]:
    """(chunk, num_warps) of the per-row programs by default: the whole row up to MAX_CHUNK columns,
    narrower pieces for ranks above 16 (ROW_TILE_ELEMS), 16 warps for a full piece (128 B elements
    per thread), fewer for smaller ones."""
    chunk = min(MAX_CHUNK, next_power_of_2(hidden), max(256, ROW_TILE_ELEMS // block_r))
    return chunk, row_warps(chunk, block_r)


def row_warps(chunk: int, block_r: int) -> int:
    """Warps of a per-row program with [chunk, block_r] pieces: one per 4096 elements, 1..16."""
    return min(16, max(1, chunk * block_r // 4096))


def fuses(num_tokens: int) -> bool:
    """A step of num_tokens rows is better off with the fused kernel than with the pair (see above)."""
    return 0 < num_tokens <= PER_ROW_MAX_TOKENS or num_tokens >= TILES_MIN_TOKENS


def tile_rows(num_tokens: int, num_segments: int, device: torch.device) -> int:
    """block_m of the tile programs: sized for the mean segment (``tile_m_for``), at most 32 rows
    (32 and 16 measured alike at 16384 rows, 64 slower); 16 under the interpreter."""
    if is_interpreted(device):
        return 16
    return min(32, tile_m_for(num_tokens, max(1, num_segments))[0])


def launch_shape(num_tokens: int, num_segments: int, device: torch.device) -> tuple:
    """What ``lora_expand_add_rms_norm`` launches by default (what Triton compiles a kernel for):
    ("rows",) or ("tiles", block_m). ``LinearLoRASlots.launch_key`` includes it."""
    if num_tokens <= PER_ROW_MAX_TOKENS:
        return ("rows",)
    return ("tiles", tile_rows(num_tokens, num_segments, device))


TILE_ELEMENTS = 4096
"""block_m * block_n of a tile program (4 warps: 32 fp32 values per thread per piece)."""

@triton.jit
def _lora_expand_add_rms_norm_kernel(
    buf_ptr, b_ptr, token_lora_slots_ptr, page_table_ptr, slot_ranks_ptr, x_ptr, residual_ptr, weight_ptr,
    out_ptr, hidden, rank, max_pages, eps,
    stride_buf_split, stride_buf_tok, stride_buf_slot, stride_x, stride_r, stride_o,
    HAS_RESIDUAL: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
    PAGE_ROWS: tl.constexpr, IDENTITY_PAGES: tl.constexpr, ROUND_TO: tl.constexpr,
):
    """Semantics, one program per row t (dtype = x's dtype, math in float32; B [num_pages, hidden,
    PAGE_ROWS], B[l] slot l's rank_l rows of its pages, ``kernels.lora_pages``; buf as
    ``lora_expand``'s, one slice, its first rank_l columns read):

        delta = rnd(sum_j buf[0, j, t, :rank_l]) @ B[l].T if l = slot(t) >= 0 else 0
        p = dtype(x[t] + delta)
        if HAS_RESIDUAL:
            s = dtype(p + residual[t]); residual[t] = s          (in place)
        else:
            s = p; x[t] = s                                       (in place)
        out[t] = dtype(weight * dtype(s / sqrt(mean(s^2) + eps)))
    """
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_lora_slots_ptr + row)
    page, sub, r_ok = _slot_rows(page_table_ptr, slot_ranks_ptr, slot, rank, max_pages, BLOCK_R, PAGE_ROWS,
                                 IDENTITY_PAGES)
    h = _token_h(buf_ptr, row, slot * 0, slot, r_ok, 0, stride_buf_split, stride_buf_tok, stride_buf_slot,
                 BLOCK_R, SPLIT_K, ROUND_TO)
    s_ptr = residual_ptr + row * stride_r if HAS_RESIDUAL else x_ptr + row * stride_x
    sq = tl.zeros([CHUNK], dtype=tl.float32)
    for c0 in range(0, hidden, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        ok = cols < hidden
        delta = _token_delta(b_ptr, page, sub, cols, ok, hidden, h, r_ok, PAGE_ROWS)       # [CHUNK] f32
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


@triton.jit(do_not_specialize=["num_active"])   # eager steps vary it: one binary for all
def _lora_expand_add_rms_norm_tile_kernel(
    buf_ptr, b_ptr, x_ptr, residual_ptr, weight_ptr, out_ptr,
    sorted_token_ids_ptr, active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr, page_table_ptr, slot_ranks_ptr,
    num_tokens, num_active, hidden, rank, max_pages, eps,
    stride_buf_split, stride_buf_tok, stride_buf_slot, stride_x, stride_r, stride_o,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    SPLIT_K: tl.constexpr, MAX_LORAS_PAD: tl.constexpr, PAGE_ROWS: tl.constexpr,
    IDENTITY_PAGES: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Semantics: as ``_lora_expand_add_rms_norm_kernel`` (the delta rounded as the expand's segment
    kernel rounds it: h to B's dtype before a native dot, or an fp32 dot with UPCAST). Program m:
    token tile m of ``kernels.lora_expand._seg_or_base_tile`` (BLOCK_M rows of one slot, or of
    base-model rows), every column in BLOCK_N pieces."""
    tok, m_ok, slot, flag, rows_left = _seg_or_base_tile(
        sorted_token_ids_ptr, active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr, tl.program_id(0),
        num_tokens, num_active, BLOCK_M, MAX_LORAS_PAD)
    if rows_left <= 0:
        return
    page, sub, r_ok = _slot_rows(page_table_ptr, slot_ranks_ptr, slot, rank, max_pages, BLOCK_R, PAGE_ROWS,
                                 IDENTITY_PAGES)
    h = _tile_h(buf_ptr, slot * 0, slot, flag, tok, m_ok, r_ok, 0, stride_buf_split, stride_buf_tok,
                stride_buf_slot, BLOCK_M, BLOCK_R, SPLIT_K)                             # [BLOCK_M, BLOCK_R]
    if not UPCAST:
        h = h.to(b_ptr.dtype.element_ty)
    x_rows = x_ptr + tok[:, None] * stride_x                                            # [BLOCK_M, 1]
    r_rows = residual_ptr + tok[:, None] * stride_r
    s_rows = r_rows if HAS_RESIDUAL else x_rows
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(0, hidden, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        ok = cols < hidden
        mask = m_ok[:, None] & ok[None, :]
        p = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        p += _tile_delta(h, b_ptr, page, sub, r_ok, flag, cols, ok, hidden, PAGE_ROWS, UPCAST, DOT_PRECISION)
        s = p.to(x_ptr.dtype.element_ty)
        if HAS_RESIDUAL:
            r = tl.load(r_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            s = (s.to(tl.float32) + r).to(x_ptr.dtype.element_ty)
        tl.store(s_rows + cols[None, :], s, mask=mask)
        s32 = s.to(tl.float32)
        sq += tl.sum(s32 * s32, axis=1)
    rstd = tl.rsqrt(sq / hidden + eps)                                                  # [BLOCK_M]
    # NOTE: the second pass may read with other threads than the first stored (the sum comes out
    # of the dot's layout): the barrier makes the program's stores visible to all its threads.
    tl.debug_barrier()
    o_rows = out_ptr + tok[:, None] * stride_o
    for c0 in range(0, hidden, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        ok = cols < hidden
        mask = m_ok[:, None] & ok[None, :]
        s = tl.load(s_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        n = (s * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(o_rows + cols[None, :], (w[None, :] * n).to(out_ptr.dtype.element_ty), mask=mask)


def lora_expand_add_rms_norm(buf: torch.Tensor, lora_b: torch.Tensor, meta: LoRAKernelMeta,
                             x: torch.Tensor, weight: torch.Tensor, eps: float,
                             residual: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                             slot_stride: int = 0, *, tiles: Optional[bool] = None,
                             block_m: Optional[int] = None, chunk: Optional[int] = None,
                             num_warps: Optional[int] = None, pages: Optional[LoRASlotPages] = None) -> torch.Tensor:
    """RMSNorm of (x + each LoRA row's update [+ residual]); the sum is stored into ``residual``
    (or into ``x`` without one), as ``kernels.layer_ops.add_rms_norm`` does.

    Args:
        buf: [1, split_k, num_tokens, rank]: ``lora_shrink``'s float32 partials, or every slot's
            shrink with slot_stride > 0 (see ``kernels.lora_expand.lora_expand``).
        lora_b: in x's dtype, contiguous: [num_pages, hidden, page_rows] with ``pages``, [max_loras, hidden,
            max_rank] without (as ``kernels.lora_expand.lora_expand``'s).
        meta: this step's ``LoRAKernelMeta`` (its token_lora_slots: < 0 for base-model / padding
            rows, which get no update).
        x: [num_tokens, hidden] the projection's base output, float16/bfloat16/float32, last dim
            contiguous.
        weight: [hidden], x's dtype. eps: added to the mean square.
        residual: optional [num_tokens, hidden] in x's dtype, last dim contiguous.
        out: optional [num_tokens, hidden] in x's dtype (may be x).
        slot_stride: see buf.
        tiles: True: segment tiles; False: per-row programs; None: tiles above PER_ROW_MAX_TOKENS rows.
        block_m: rows per tile (a power of two >= 16); None: sized for the mean segment.
        chunk, num_warps: the per-row programs' columns per piece (a power of two) and warps;
            None: ``row_launch`` (rank 16: the whole row up to MAX_CHUNK columns, 16 warps at
            4096; larger ranks: narrower pieces, same B elements per thread). (16 warps,
            although on an H200 the isolated sweeps favour 8, both with a cold L2
            (``benchmarks/sweeps/lora_prefill_sweep.py --fused-consumers``) and back to back
            (``benchmarks/sweeps/lora_decode_sweep.py``): inside the engine's batch-64 decode
            step 16 warps were faster with 16 and 64 adapters, by step time
            (``benchmarks/multi_lora.py``) and per call in the decode graph
            (``benchmarks/profile_step.py``).)
        pages: the slots' page table (None: the padded layout), as ``lora_expand``'s.

    Returns:
        out: the normalized rows.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, hidden = x.shape
    dev = x.device
    check_tensor("weight", weight, dtypes=(x.dtype,), shape=(hidden,), device=dev, contiguous=True)
    split_k, rank = check_shrink_output(buf, 1, num_tokens, x, slot_stride)
    _check_meta(meta, num_tokens, meta.max_loras, dev)
    pages = slice_pages([lora_b], meta, pages)
    check_tensor("lora_b", lora_b, ndim=3, dtypes=(x.dtype,), shape=(None, hidden, pages.page_rows), device=dev,
                 contiguous=True)
    check_tensor("meta.token_lora_slots", meta.token_lora_slots, dtypes=(torch.int32,), shape=(num_tokens,),
                 device=dev, contiguous=True)
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), shape=(num_tokens, hidden), device=dev,
                     last_dim_contiguous=True)
    if out is None:
        out = torch.empty_like(x)                                                      # [T, hidden]
    check_tensor("out", out, dtypes=(x.dtype,), shape=(num_tokens, hidden), device=dev, last_dim_contiguous=True)
    if num_tokens == 0:
        return out
    block_r = max(16, next_power_of_2(rank))
    res = residual if residual is not None else x
    if tiles is None:
        tiles = num_tokens > PER_ROW_MAX_TOKENS
    if not tiles:
        chunk = chunk or row_launch(hidden, block_r)[0]
        if chunk & (chunk - 1):
            raise ValueError(f"chunk: {chunk} must be a power of two.")
        _lora_expand_add_rms_norm_kernel[(num_tokens,)](
            buf, lora_b, meta.token_lora_slots, pages.page_table, pages.slot_ranks, x, res, weight, out,
            hidden, rank, pages.max_pages, float(eps),
            buf.stride(1), buf.stride(2), slot_stride, x.stride(0), res.stride(0), out.stride(0),
            HAS_RESIDUAL=residual is not None, CHUNK=chunk, BLOCK_R=block_r, SPLIT_K=split_k,
            PAGE_ROWS=pages.page_rows,
            IDENTITY_PAGES=pages.identity, ROUND_TO=h_round_dtype(x), num_warps=num_warps or row_warps(chunk, block_r))
        return out
    num_active = 0 if meta.no_lora else meta.num_active
    if block_m is None:
        block_m = tile_rows(num_tokens, num_active, dev)
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m: {block_m} must be a power of two >= 16.")
    block_n = min(next_power_of_2(hidden), max(16, TILE_ELEMENTS // block_m))
    grid = (num_tokens // block_m + num_active + cdiv(num_tokens, block_m),)
    _lora_expand_add_rms_norm_tile_kernel[grid](
        buf, lora_b, x, res, weight, out,
        meta.sorted_token_ids, meta.active_slots, meta.num_tokens_per_slot, meta.slot_start, pages.page_table,
        pages.slot_ranks, num_tokens, num_active, hidden, rank, pages.max_pages, float(eps),
        buf.stride(1), buf.stride(2), slot_stride, x.stride(0), res.stride(0), out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, SPLIT_K=split_k,
        MAX_LORAS_PAD=next_power_of_2(meta.max_loras), PAGE_ROWS=pages.page_rows,
        IDENTITY_PAGES=pages.identity, UPCAST=expand_upcast(x),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4)
    return out
