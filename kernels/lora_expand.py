"""LoRA expand: y[t, slice] += (sum_j buf[s, j, t]) @ B_s[slot(t)].T (Punica SGMV, one Triton kernel).

The counterpart of ``kernels.lora_shrink``: same segment walk over ``LoRAKernelMeta``, one
program per (token tile of one adapter segment, column range, slice). Slices are the parts of a
packed projection (q, k, v of qkv_proj; gate, up of gate_up_proj), each with its own B tensor and
output width, written side by side into y at ``slice_offsets``. Up to ``MAX_SLICES`` slices go
through one launch (their B pointers are separate kernel arguments).

A program loads its tokens' shrink output once, summing the ``split_k`` fp32 partials that
``lora_shrink`` stored (``buf.shape[1]``), then walks ``n_tiles`` column tiles of ``block_n``
(streaming that adapter's B), so the per-program work (segment search, token ids, partials)
is paid once per ``block_n * n_tiles`` columns, not once per tile.

Per-token programs (``LoRAExpandConfig.per_token``, Punica's BGMV): one program per (token,
column range, slice), no segment walk. The program's prologue is one load of the token's slot,
then its partials, its B rows and its y columns all at once (one dependent memory round trip
instead of the segment walk's three), and the update is a broadcast multiply-add over the rank,
no dot. Tokens that share an adapter each stream its B (from L2 after the first), which suits
decode steps, where most segments are a few tokens.

Launch configs (``LoRAExpandConfig``) come from ``lora_expand_config``: as many column tiles per
program as keep a few waves of programs with work when segments are as small as they can be.
``KernelPolicy.lora_expand`` overrides fields of ``LoRAExpandConfig`` (``CHORUS_KERNEL_POLICY``
items such as ``lora_expand.block_n=256,lora_expand.n_tiles=4``); ``lora.layers`` passes the
engine's overrides to every launch.

Numerics: the shrink's fp32 sum is rounded to B's dtype before the dot on float16/bfloat16 GPUs
(as PEFT's ``lora_B(lora_A(x))`` rounds ``lora_A(x)``), and the dot runs on the tensor cores'
native path with fp32 accumulation; float32 (and the interpreter) keep h in fp32.

The torch twin is ``kernels.reference.lora_expand_ref``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

import triton
import triton.language as tl

from kernels.lora_meta import LoRAKernelMeta
from kernels.lora_pages import LoRASlotPages, padded_pages
from kernels.lora_shrink import (PROGRAMS_PER_SM, ConfigOverride, _check_launch, _check_meta, _check_pow2,
                                 _find_segment, _slot_rows, _tile_tokens, tile_m_for)
from kernels.utils import (FLOAT_DTYPES, cdiv, check_int, check_tensor, is_interpreted, next_power_of_2,
                           num_sms)

MAX_SLICES = 3

PER_TOKEN_MAX_TOKENS = 128
"""Decode steps of at most this many tokens may take the per-token programs by default ..."""
PER_TOKEN_MAX_PER_SEGMENT = 4
"""... when they have at most this many tokens per segment on average (``lora_expand_config``)."""

MAX_N_TILES = 32
"""The most column tiles one program walks."""

TOKEN_TILE_ELEMS_PER_WARP = 4096
"""Per-token programs hold a [block_n, BLOCK_R] tile of B per slice in registers: at most this many
elements per warp (128 per thread, as the rank-16 decode configs measured on the H200). Larger
ranks walk narrower tiles over the same columns (``token_block_n``) instead of spilling registers."""


def token_block_n(block_n: int, block_r: int, num_warps: int) -> int:
    """The per-token programs' column tile for a rank padded to block_r: ``block_n``, narrowed to
    keep the B tile within TOKEN_TILE_ELEMS_PER_WARP per warp (rank 16: unchanged up to 256 columns
    per warp; rank 64 with 2 warps: 128). The columns per program stay ``block_n * n_tiles``."""
    return max(16, min(block_n, TOKEN_TILE_ELEMS_PER_WARP * num_warps // block_r))


@triton.jit
def _slice_of(pid_s, b0_ptr, b1_ptr, b2_ptr, n0, n1, n2, off0, off1, off2):
    """(B pointer, output width, first column in y) of slice ``pid_s``.

    NOTE: selects, not if/else: a size of 1 is specialized to a constant and the branches would
    disagree on types; the sizes keep their divisibility, so y's accesses stay vectorized.
    """
    b_ptr = tl.where(pid_s == 0, b0_ptr, tl.where(pid_s == 1, b1_ptr, b2_ptr))
    n_out = tl.where(pid_s == 0, n0, tl.where(pid_s == 1, n1, n2))
    col0 = tl.where(pid_s == 0, off0, tl.where(pid_s == 1, off1, off2))
    return b_ptr, n_out, col0


@triton.jit
def _b_cols(b_ptr, page, sub, n_out, PAGE_ROWS: tl.constexpr):
    """[BLOCK_R] pointers to B[n = 0] of each rank row (page, sub from ``_slot_rows``): B of one slice is
    [num_pages, n_out, PAGE_ROWS] contiguous (``kernels.lora_pages``), column n is PAGE_ROWS further."""
    return b_ptr + page * n_out * PAGE_ROWS + sub


@triton.jit
def _expand_tile(h, b_ptr, y_ptr, page, sub, r_ok, tok, m_ok, n_out, col0, n_lo, cols_per_program, stride_y_tok,
                 BLOCK_N: tl.constexpr, PAGE_ROWS: tl.constexpr, ADD_INPUTS: tl.constexpr,
                 UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """y[tok, col0 + n] = (y[tok, col0 + n] if ADD_INPUTS else 0) + h @ B_l[n].T for the columns
    n in [n_lo, n_lo + cols_per_program) of the slice (h: [BLOCK_M, BLOCK_R] fp32; B_l: the slot's
    rank rows, page / sub / r_ok from ``_slot_rows``).

    UPCAST: B to fp32 and a DOT_PRECISION dot (float32 models, the interpreter); else h is
    rounded to B's dtype and the dot runs on its native tensor-core path (fp32 accumulation)."""
    if not UPCAST:
        h = h.to(b_ptr.dtype.element_ty)
    b_rows = _b_cols(b_ptr, page, sub, n_out, PAGE_ROWS)[None, :]                    # [1, BLOCK_R]
    y_rows = y_ptr + tok[:, None] * stride_y_tok + col0                                 # [BLOCK_M, 1]
    n_end = n_lo + cols_per_program
    for c0 in range(n_lo, tl.minimum(n_end, n_out), BLOCK_N):
        offs_n = c0 + tl.arange(0, BLOCK_N)
        n_ok = (offs_n < n_out) & (offs_n < n_end)          # two bounds: no min(), see lora_shrink
        b = tl.load(b_rows + offs_n[:, None] * PAGE_ROWS, mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        if UPCAST:
            delta = tl.dot(h, tl.trans(b.to(tl.float32)), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        else:
            delta = tl.dot(h, tl.trans(b))                                              # [BLOCK_M, BLOCK_N] f32
        y_ptrs = y_rows + offs_n[None, :]
        y_mask = m_ok[:, None] & n_ok[None, :]
        if ADD_INPUTS:
            delta += tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, delta.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit(do_not_specialize=["num_active"])   # eager steps vary it: one binary for all
def _lora_expand_kernel(
    buf_ptr, y_ptr, b0_ptr, b1_ptr, b2_ptr,
    sorted_token_ids_ptr, active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr, page_table_ptr, slot_ranks_ptr,
    num_active, rank, max_pages, n0, n1, n2, off0, off1, off2, cols_per_program,
    stride_buf_slice, stride_buf_split, stride_buf_tok, stride_buf_slot, stride_y_tok,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
    MAX_LORAS_PAD: tl.constexpr, PAGE_ROWS: tl.constexpr,
    IDENTITY_PAGES: tl.constexpr, ADD_INPUTS: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Semantics (B_s = [b0, b1, b2][s], each [num_pages, n_s, PAGE_ROWS] contiguous, B_s[l] slot l's
    [n_s, rank_l] of its pages, rank_l = slot_ranks[l], ``kernels.lora_pages``; buf[s, j, t] is read at
    ``slot(t) * stride_buf_slot`` past its strided address, see ``lora_expand``'s slot_stride):

        for s in range(num_slices), t in range(num_tokens):
          if slot(t) >= 0:
            h = sum(buf[s, j, t, :rank_l] for j in range(SPLIT_K))          # fp32, [rank_l], l = slot(t)
            delta = h @ B_s[l].T                                              # fp32, [n_s]
            y[t, off_s:off_s + n_s] = (y[t, off_s:off_s + n_s] if ADD_INPUTS else 0) + delta

    Program (m, n, s) covers columns [n * cols_per_program, (n + 1) * cols_per_program) of slice s.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    b_ptr, n_out, col0 = _slice_of(pid_s, b0_ptr, b1_ptr, b2_ptr, n0, n1, n2, off0, off1, off2)
    n_lo = pid_n * cols_per_program
    if n_lo >= n_out:
        return
    slot, count, start, tile = _find_segment(active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr, pid_m,
                                             num_active, BLOCK_M, MAX_LORAS_PAD)
    if slot < 0 or tile * BLOCK_M >= count:
        return
    tok, m_ok = _tile_tokens(sorted_token_ids_ptr, start, count, tile, BLOCK_M)         # [BLOCK_M]
    page, sub, r_ok = _slot_rows(page_table_ptr, slot_ranks_ptr, slot, rank, max_pages, BLOCK_R, PAGE_ROWS,
                                 IDENTITY_PAGES)

    offs_r = tl.arange(0, BLOCK_R)
    mr_ok = m_ok[:, None] & r_ok[None, :]
    buf_rows = (buf_ptr + pid_s.to(tl.int64) * stride_buf_slice + slot.to(tl.int64) * stride_buf_slot
                + tok[:, None] * stride_buf_tok + offs_r[None, :])                     # [BLOCK_M, BLOCK_R]
    h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for j in tl.static_range(SPLIT_K):                     # unrolled: the partial loads overlap
        h += tl.load(buf_rows + j * stride_buf_split, mask=mr_ok, other=0.0).to(tl.float32)   # [BLOCK_M, BLOCK_R]
    _expand_tile(h, b_ptr, y_ptr, page, sub, r_ok, tok, m_ok, n_out, col0, n_lo, cols_per_program, stride_y_tok,
                 BLOCK_N, PAGE_ROWS, ADD_INPUTS, UPCAST, DOT_PRECISION)


@triton.jit
def _seg_or_base_tile(sorted_token_ids_ptr, active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr, pid_m,
                      num_tokens, num_active, BLOCK_M: tl.constexpr, MAX_LORAS_PAD: tl.constexpr):
    """Rows of token tile ``pid_m`` of a launch whose first ``num_tokens // BLOCK_M + num_active``
    tiles walk the adapter segments (as the expand's) and whose next ``cdiv(num_tokens, BLOCK_M)``
    tiles cover the base-model rows (sorted after every adapter's rows, ``LoRAKernelMeta``).

    Returns (tok [BLOCK_M] int64, m_ok [BLOCK_M], slot, flag, rows_left): the rows of a tile share
    ``slot`` (0 on a base tile); flag is int32 1 on a segment tile, 0 on a base tile (whose B reads
    ``_tile_h`` / ``_tile_delta`` mask off); rows_left <= 0: the tile has no rows (return at once).
    """
    seg_tiles = num_tokens // BLOCK_M + num_active
    if pid_m < seg_tiles:
        slot, count, start, tile = _find_segment(active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr,
                                                 pid_m, num_active, BLOCK_M, MAX_LORAS_PAD)
        is_lora = slot >= 0
    else:
        # Base-model rows: sorted after the adapters' rows, i.e. from sum(counts) on.
        a = tl.arange(0, MAX_LORAS_PAD)
        counts = tl.load(num_tokens_per_slot_ptr + a, mask=a < num_active, other=0)
        start = tl.sum(counts, axis=0)
        count = num_tokens - start
        tile = pid_m - seg_tiles
        slot = start * 0                       # an int32 0: B reads are masked off with lora
        is_lora = start < 0                    # False, as a tensor (both branches give one type)
    tok, m_ok = _tile_tokens(sorted_token_ids_ptr, start, count, tile, BLOCK_M)         # [BLOCK_M]
    return tok, m_ok, tl.maximum(slot, 0), is_lora.to(tl.int32), count - tile * BLOCK_M


@triton.jit
def _tile_h(buf_ptr, pid_s, slot, flag, tok, m_ok, r_ok, stride_buf_slice, stride_buf_split, stride_buf_tok,
            stride_buf_slot, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr):
    """[BLOCK_M, BLOCK_R] fp32: the summed shrink partials of slice pid_s for the rows tok of one
    slot (0 on a base tile, flag 0, and where not m_ok or not r_ok: past the slot's rank)."""
    offs_r = tl.arange(0, BLOCK_R)
    # NOTE: the flag broadcast as an int vector: the interpreter rejects masks of a scalar bool & a vector.
    lora = m_ok & (tl.zeros([BLOCK_M], tl.int32) + flag > 0)
    mask = lora[:, None] & r_ok[None, :]
    rows = (buf_ptr + pid_s.to(tl.int64) * stride_buf_slice + slot.to(tl.int64) * stride_buf_slot
            + tok[:, None] * stride_buf_tok + offs_r[None, :])                          # [BLOCK_M, BLOCK_R]
    h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for j in tl.static_range(SPLIT_K):                     # unrolled: the partial loads overlap
        h += tl.load(rows + j * stride_buf_split, mask=mask, other=0.0).to(tl.float32)
    return h


@triton.jit
def _tile_delta(h, b_ptr, page, sub, r_ok, flag, cols, ok, n_out, PAGE_ROWS: tl.constexpr, UPCAST: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """[BLOCK_M, len(cols)] fp32: h @ B_l[cols].T for one slot's rows (h from ``_tile_h``; page, sub,
    r_ok: the slot's rank rows, ``_slot_rows``; a base tile, flag 0, reads no B and gets 0). UPCAST as
    ``_expand_tile``'s: an fp32 dot; else h rounded to B's dtype and the native tensor-core dot (fp32
    accumulation)."""
    b_ok = ok & (cols * 0 + flag > 0)
    b = tl.load(_b_cols(b_ptr, page, sub, n_out, PAGE_ROWS)[None, :] + cols[:, None] * PAGE_ROWS,
                mask=b_ok[:, None] & r_ok[None, :], other=0.0)                          # [N, BLOCK_R]
    if UPCAST:
        return tl.dot(h, tl.trans(b.to(tl.float32)), input_precision=DOT_PRECISION)
    return tl.dot(h.to(b_ptr.dtype.element_ty), tl.trans(b))


@triton.jit
def _token_h(buf_ptr, t, pid_s, slot, r_ok, stride_buf_slice, stride_buf_split, stride_buf_tok, stride_buf_slot,
             BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr, ROUND_TO: tl.constexpr):
    """Token t's summed shrink partials of slice pid_s ([BLOCK_R] fp32; 0 where not r_ok: slot < 0 or
    r past the slot's rank, ``_slot_rows``), rounded through ROUND_TO (B's dtype on a GPU's native path,
    as the dot rounds h; fp32: none)."""
    offs_r = tl.arange(0, BLOCK_R)
    rows = (buf_ptr + pid_s.to(tl.int64) * stride_buf_slice + tl.maximum(slot, 0).to(tl.int64) * stride_buf_slot
            + t * stride_buf_tok + offs_r)
    h = tl.zeros([BLOCK_R], dtype=tl.float32)
    for j in tl.static_range(SPLIT_K):                     # unrolled: the partial loads overlap
        h += tl.load(rows + j * stride_buf_split, mask=r_ok, other=0.0).to(tl.float32)
    return h.to(ROUND_TO).to(tl.float32)


@triton.jit
def _token_delta(b_ptr, page, sub, offs_n, n_ok, n_out, h, r_ok, PAGE_ROWS: tl.constexpr):
    """[BLOCK_N] fp32: h @ B_l[offs_n].T as a multiply-add over the slot's rank rows (page, sub, r_ok
    from ``_slot_rows``; B masked off where r_ok is false, so a base-model token reads nothing, gets 0)."""
    b_ptrs = _b_cols(b_ptr, page, sub, n_out, PAGE_ROWS)[None, :] + offs_n[:, None] * PAGE_ROWS
    b = tl.load(b_ptrs, mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)   # [BLOCK_N, BLOCK_R]
    return tl.sum(b * h[None, :], axis=1)


@triton.jit
def _lora_expand_token_kernel(
    buf_ptr, y_ptr, b0_ptr, b1_ptr, b2_ptr, token_lora_slots_ptr, page_table_ptr, slot_ranks_ptr,
    rank, max_pages, n0, n1, n2, off0, off1, off2, cols_per_program,
    stride_buf_slice, stride_buf_split, stride_buf_tok, stride_buf_slot, stride_y_tok,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr, PAGE_ROWS: tl.constexpr,
    IDENTITY_PAGES: tl.constexpr,
    ADD_INPUTS: tl.constexpr, ROUND_TO: tl.constexpr,
):
    """Semantics: as ``_lora_expand_kernel`` (same buf, B, page and y layouts); program (t, n, s) covers
    token t and columns [n * cols_per_program, (n + 1) * cols_per_program) of slice s:

        if slot(t) >= 0:
          h = rnd(sum(buf[s, j, t, :rank_l] for j in range(SPLIT_K)))     # fp32, [rank_l], l = slot(t)
          y[t, off_s + cols] = (y[t, off_s + cols] if ADD_INPUTS else 0) + h @ B_s[l, cols].T

    rnd: through ROUND_TO (B's dtype on the native path, as the segment kernel's dot rounds h).
    """
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    b_ptr, n_out, col0 = _slice_of(pid_s, b0_ptr, b1_ptr, b2_ptr, n0, n1, n2, off0, off1, off2)
    n_lo = pid_n * cols_per_program
    slot = tl.load(token_lora_slots_ptr + t)
    if slot < 0 or n_lo >= n_out:
        return
    page, sub, r_ok = _slot_rows(page_table_ptr, slot_ranks_ptr, slot, rank, max_pages, BLOCK_R, PAGE_ROWS,
                                 IDENTITY_PAGES)
    h = _token_h(buf_ptr, t, pid_s, slot, r_ok, stride_buf_slice, stride_buf_split, stride_buf_tok,
                 stride_buf_slot, BLOCK_R, SPLIT_K, ROUND_TO)
    y_row = y_ptr + t * stride_y_tok + col0
    n_end = n_lo + cols_per_program
    for c0 in range(n_lo, tl.minimum(n_end, n_out), BLOCK_N):
        offs_n = c0 + tl.arange(0, BLOCK_N)
        n_ok = (offs_n < n_out) & (offs_n < n_end)
        delta = _token_delta(b_ptr, page, sub, offs_n, n_ok, n_out, h, r_ok, PAGE_ROWS)    # [BLOCK_N] f32
        if ADD_INPUTS:
            delta += tl.load(y_row + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_row + offs_n, delta.to(y_ptr.dtype.element_ty), mask=n_ok)


@dataclass(frozen=True)
class LoRAExpandConfig:
    """Launch parameters of the expand kernel (``KernelPolicy.lora_expand`` overrides these fields)."""

    block_m: int = 16
    """Tokens per tile: a power of two >= 16 (the smallest tl.dot tile)."""
    block_n: int = 128
    """Output columns per inner step: a power of two >= 16."""
    n_tiles: int = 1
    """Column tiles one program walks (a power of two <= MAX_N_TILES): a program covers
    block_n * n_tiles columns of one slice."""
    num_warps: int = 4
    """Warps per program (1..16, a power of two)."""
    num_stages: int = 2
    """Software-pipelining depth of the column loop (>= 1)."""
    per_token: int = 0
    """1: one program per (token, column range) (BGMV, see the module docstring; block_m unused);
    0: one per (segment token tile, column range)."""

    def __post_init__(self) -> None:
        _check_pow2("block_m", self.block_m, 16)
        _check_pow2("block_n", self.block_n, 16)
        _check_pow2("n_tiles", self.n_tiles, 1, MAX_N_TILES)
        _check_launch(self.num_warps, self.num_stages)
        if self.per_token not in (0, 1):
            raise ValueError(f"per_token: {self.per_token!r} must be 0 or 1.")


@functools.lru_cache(maxsize=4096)
def lora_expand_config(num_tokens: int, num_segments: int, out_dims: tuple[int, ...], device: torch.device,
                       override: ConfigOverride = ()) -> LoRAExpandConfig:
    """The default launch config for one expand, with ``override`` fields applied last.

    Args:
        num_tokens: rows of y.
        num_segments: ``meta.num_active`` (max_loras with a fixed grid: sized for the worst case).
        out_dims: output width of each slice.
        device: where it runs (SM count; CPU means the interpreter: small tiles).
        override: (field, value) pairs, e.g. ``KernelPolicy.lora_expand``.
    """
    block_m, tiles = tile_m_for(num_tokens, num_segments)
    if is_interpreted(device):
        cfg = LoRAExpandConfig(16, min(32, max(16, next_power_of_2(max(out_dims)))), 2, 4)
    else:
        if block_m <= 16:
            # NOTE: defaults from benchmarks/sweeps/lora_prefill_sweep.py --tokens 64,256 on an
            # H200 (benchmarks/RESULTS.md, "Launch configs and constants inside the kernels").
            # Short segments want short programs: 256 columns each (128 x 2), 512 for slices
            # wider than 8192 (gate/up of Llama-3-8B), close to the best candidate of every decode
            # case. Decode steps of few tokens per segment take per-token programs of 512 columns,
            # 2 warps: at 64 tokens the best per-token candidate on o / down with 1, 16 and 64
            # adapters and ahead of (q/k/v with 1 adapter: level with) the segment programs; at 128
            # tokens ahead with 64 segments, behind with 16; at 256 behind. Each token streams its
            # adapter's B (from L2 after the first), hence the bounds.
            if num_tokens <= PER_TOKEN_MAX_TOKENS and num_tokens <= PER_TOKEN_MAX_PER_SEGMENT * max(1, num_segments):
                cfg = LoRAExpandConfig(block_m, 512, 1, 2, 2, per_token=1)
            else:
                cfg = LoRAExpandConfig(block_m, 128, 4 if max(out_dims) > 8192 else 2, 4, 2)
        else:
            cfg = LoRAExpandConfig(block_m, 128, widest_n_tiles(tiles, out_dims, 128, device), 4, 2)
    return dataclasses.replace(cfg, **dict(override))


def widest_n_tiles(tiles: int, out_dims: tuple[int, ...], block_n: int, device: torch.device) -> int:
    """Most column tiles per program (a power of two <= MAX_N_TILES) that still leave
    PROGRAMS_PER_SM programs with work per SM, for ``tiles`` token tiles over the slices' columns."""
    def programs(n_tiles: int) -> int:
        return tiles * sum(cdiv(n, block_n * n_tiles) for n in out_dims)

    n_tiles, target = 1, PROGRAMS_PER_SM * num_sms(device)
    while n_tiles * 2 <= MAX_N_TILES and programs(n_tiles * 2) >= target:
        n_tiles *= 2
    return n_tiles


def expand_upcast(y: torch.Tensor) -> bool:
    """The expand's dot upcasts B to float32 (the kernels' UPCAST): for float32 tensors (B has y's
    dtype, ``check_b_slices``), and under the interpreter (its bfloat16 arithmetic is wrong);
    float16/bfloat16 on a GPU dot natively."""
    return is_interpreted(y.device) or y.dtype == torch.float32


def h_round_dtype(y: torch.Tensor):
    """Triton dtype the per-token kernels round h through: B's (= y's) dtype where the segment
    kernels dot natively, float32 (no rounding) where they upcast (``expand_upcast``)."""
    if expand_upcast(y):
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[y.dtype]


def slice_pages(lora_b_slices: Sequence[torch.Tensor], meta: LoRAKernelMeta,
                pages: Optional[LoRASlotPages]) -> LoRASlotPages:
    """The page table an expand of these B slices reads: ``pages``, checked against meta's slots and
    B's page rows; None: the padded layout, B [max_loras, out_s, max_rank] (``kernels.lora_pages``)."""
    b0 = lora_b_slices[0]
    if not isinstance(b0, torch.Tensor) or b0.dim() != 3:
        raise ValueError("lora_b_slices[0]: expected a 3-d tensor [num_pages, out_dim, page_rows].")
    if pages is None:
        if b0.shape[0] != meta.max_loras:
            raise ValueError(f"meta: built for max_loras={meta.max_loras}, the weights have {b0.shape[0]} slots.")
        pages = padded_pages(meta.max_loras, b0.shape[2], b0.device)
    pages.check(meta.max_loras, b0.device)
    if b0.shape[2] != pages.page_rows:
        raise ValueError(f"lora_b_slices[0]: {b0.shape[2]} rows per page, the page table has {pages.page_rows}.")
    return pages


def check_b_slices(lora_b_slices: Sequence[torch.Tensor], y: torch.Tensor, page_rows: int,
                   slice_offsets: Sequence[int]) -> tuple[int, ...]:
    """B of each slice ([num_pages, out_s, page_rows], one num_pages) fits y (dtype, device, columns);
    returns out_dims."""
    num_pages = lora_b_slices[0].shape[0] if isinstance(lora_b_slices[0], torch.Tensor) else -1
    for s, b in enumerate(lora_b_slices):
        check_tensor(f"lora_b_slices[{s}]", b, ndim=3, dtypes=(y.dtype,), shape=(num_pages, None, page_rows),
                     device=y.device, contiguous=True)
    if not isinstance(slice_offsets, (list, tuple)) or len(slice_offsets) != len(lora_b_slices):
        raise ValueError(f"slice_offsets: expected {len(lora_b_slices)} host ints (one per slice), "
                         f"got {slice_offsets!r}.")
    total_out = y.shape[1]
    for s, (b, off) in enumerate(zip(lora_b_slices, slice_offsets)):
        check_int(f"slice_offsets[{s}]", off)
        if off + b.shape[1] > total_out:
            raise ValueError(f"slice_offsets[{s}]: columns [{off}, {off + b.shape[1]}) exceed y's "
                             f"{total_out}.")
    return tuple(b.shape[1] for b in lora_b_slices)


def slotwise_buf(h_all: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(buf, slot_stride) for ``lora_expand`` / ``lora_expand_silu_mul`` from every slot's shrink.

    h_all: [num_tokens, num_slots, num_slices, rank], last dim contiguous (e.g. a view of the
    stacked GEMM's extra columns, ``lora.layers``): h_all[t, l, s] = x[t] @ A_s[l].T.
    Returns buf [num_slices, 1, num_tokens, rank] (slot 0's h) and the element stride between slots.
    """
    buf = h_all[:, 0].permute(1, 0, 2).unsqueeze(1)                    # [S, 1, T, R]
    return buf, h_all.stride(1)


def check_shrink_output(buf: torch.Tensor, num_slices: int, num_tokens: int, y: torch.Tensor,
                        slot_stride: int) -> tuple[int, int]:
    """Check an expand's input (see ``lora_expand``'s buf and slot_stride); returns (split_k, rank)."""
    check_int("slot_stride", slot_stride)
    if slot_stride < 0:
        raise ValueError(f"slot_stride: {slot_stride} must be >= 0.")
    dtypes = (torch.float32,) if slot_stride == 0 else (torch.float32, y.dtype)
    check_tensor("buf", buf, ndim=4, dtypes=dtypes, device=y.device, last_dim_contiguous=True)
    split_k, rank = buf.shape[1], buf.shape[3]
    check_tensor("buf", buf, shape=(num_slices, split_k, num_tokens, rank))
    if split_k < 1:
        raise ValueError("buf: split_k (dim 1) must be >= 1.")
    return split_k, rank


def lora_expand(buf: torch.Tensor, lora_b_slices: Sequence[torch.Tensor], meta: LoRAKernelMeta,
                y: torch.Tensor, slice_offsets: Sequence[int], add_inputs: bool = True, *,
                config: Optional[LoRAExpandConfig] = None, slot_stride: int = 0,
                pages: Optional[LoRASlotPages] = None) -> None:
    """Add each LoRA token's B-projection of its summed shrink partials into its columns of y, in place
    (token t of slot l reads h's first rank_l columns and slot l's rank_l rows of B, nothing past them).

    Args:
        buf: [num_slices, split_k, num_tokens, rank], last dim contiguous (any other strides; rank at
            least every slot's): float32 ``lora_shrink`` partials; or, with slot_stride > 0, the shrink
            of every slot (float32 or y's dtype), token t's own h at ``slot(t) * slot_stride`` elements
            past buf[s, j, t] (the stacked GEMM's output, ``lora.layers``: split_k 1). The caller
            guarantees every slot in meta lies inside that layout.
        lora_b_slices: num_slices (1..3) tensors in y's dtype, contiguous: with ``pages``, the pools
            [num_pages, out_dim_s, page_rows] (``kernels.lora_pages``); without, [max_loras, out_dim_s, max_rank].
        meta: this step's ``LoRAKernelMeta``.
        y: [num_tokens, total_out] float16/bfloat16/float32, last dim contiguous.
        slice_offsets: num_slices host ints, column of y where slice s starts
            (off_s + out_dim_s <= total_out).
        add_inputs: True adds to y (fp32 sum, then cast); False overwrites those columns.
            Rows of base-model tokens are never touched.
        config: launch config; None: ``lora_expand_config``'s default.
        slot_stride: 0 (buf holds each token's own partials) or see buf.
        pages: the slots' page table (None: the padded layout, ``kernels.lora_pages.padded_pages``).
    """
    check_tensor("y", y, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, total_out = y.shape
    dev = y.device
    if not isinstance(lora_b_slices, (list, tuple)) or not 1 <= len(lora_b_slices) <= MAX_SLICES:
        raise ValueError(f"lora_b_slices: expected a list/tuple of 1..{MAX_SLICES} tensors.")
    num_slices = len(lora_b_slices)
    split_k, rank = check_shrink_output(buf, num_slices, num_tokens, y, slot_stride)
    _check_meta(meta, num_tokens, meta.max_loras, dev)
    pages = slice_pages(lora_b_slices, meta, pages)
    out_dims = check_b_slices(lora_b_slices, y, pages.page_rows, slice_offsets)
    if config is None:
        config = lora_expand_config(num_tokens, meta.num_active, out_dims, dev)
    if meta.no_lora or num_tokens == 0:
        return

    pad = MAX_SLICES - num_slices
    b_args = list(lora_b_slices) + [lora_b_slices[0]] * pad
    n_args = list(out_dims) + [0] * pad
    off_args = [int(o) for o in slice_offsets] + [0] * pad
    cols_per_program = config.block_n * config.n_tiles
    block_r = max(16, next_power_of_2(rank))
    if config.per_token:
        _lora_expand_token_kernel[(num_tokens, cdiv(max(out_dims), cols_per_program), num_slices)](
            buf, y, *b_args, meta.token_lora_slots, pages.page_table, pages.slot_ranks, rank, pages.max_pages,
            *n_args, *off_args, cols_per_program,
            buf.stride(0), buf.stride(1), buf.stride(2), slot_stride, y.stride(0),
            BLOCK_N=token_block_n(config.block_n, block_r, config.num_warps), BLOCK_R=block_r, SPLIT_K=split_k,
            PAGE_ROWS=pages.page_rows,
            IDENTITY_PAGES=pages.identity, ADD_INPUTS=bool(add_inputs), ROUND_TO=h_round_dtype(y), num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        return
    grid = (num_tokens // config.block_m + meta.num_active, cdiv(max(out_dims), cols_per_program), num_slices)
    _lora_expand_kernel[grid](
        buf, y, *b_args,
        meta.sorted_token_ids, meta.active_slots, meta.num_tokens_per_slot, meta.slot_start, pages.page_table,
        pages.slot_ranks, meta.num_active, rank, pages.max_pages, *n_args, *off_args, cols_per_program,
        buf.stride(0), buf.stride(1), buf.stride(2), slot_stride, y.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_R=max(16, next_power_of_2(rank)),
        SPLIT_K=split_k, MAX_LORAS_PAD=next_power_of_2(meta.max_loras), PAGE_ROWS=pages.page_rows,
        IDENTITY_PAGES=pages.identity,
        ADD_INPUTS=bool(add_inputs), UPCAST=expand_upcast(y),
        DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
