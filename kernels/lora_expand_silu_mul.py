"""LoRA expand fused into SiLU-and-mul: out[t] = silu(gate[t] + dg[t]) * (up[t] + du[t]), one launch.

The MLP's packed gate/up projection is followed by SiLU-and-mul, which reads the whole [T, 2d]
projection output anyway. The split LoRA path adds the adapter update into that output first
(``kernels.lora_expand``: a read-modify-write of [T, 2d], and a launch on the critical path
after the GEMM), then SiLU-and-mul reads it again. This kernel does both from the shrink's
partials: dg = h_gate @ B_gate[slot].T and du = h_up @ B_up[slot].T per token, added to the
GEMM's gate and up in registers, and only the [T, d] activation is written. At a prefill step of
16384 tokens on Llama-3-8B that removes 1.9 GB of traffic per decoder layer; at decode it removes
one launch per layer.

Programs: token tiles x column ranges (``block_n * n_tiles`` columns of d). The first
``num_tokens // block_m + num_active`` token tiles walk the adapter segments as the expand does
(``LoRAKernelMeta``); the next ``cdiv(num_tokens, block_m)`` cover the base-model rows, which
``group_slots_host`` sorts after every adapter's rows (delta 0: plain SiLU-and-mul). Tiles
without rows return at once.

Numerics, as the unfused pair (expand, then ``kernels.layer_ops.silu_and_mul``): the deltas as
the expand computes them (``kernels.lora_expand``: h rounded to B's dtype for a native dot on
float16/bfloat16 GPUs), gate and up rounded to the activation dtype after the fp32 add, SiLU's
output rounded before ``* up``.

With ``LoRAExpandConfig.per_token`` the programs are (token, column range) instead, as the
expand's per-token kernel (``kernels.lora_expand``; a base-model token reads no B).

Launch configs are ``LoRAExpandConfig``s (``lora_expand_silu_mul_config``; the
``KernelPolicy.lora_expand`` overrides apply to this kernel too). The torch twin is
``kernels.reference.lora_expand_silu_mul_ref``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import torch

import triton
import triton.language as tl

from kernels.lora_expand import (PER_TOKEN_MAX_TOKENS, LoRAExpandConfig, _seg_or_base_tile, _tile_delta, _tile_h,
                                 _token_delta, _token_h, check_b_slices, check_shrink_output, expand_upcast,
                                 h_round_dtype, lora_expand_config, slice_pages, token_block_n)
from kernels.lora_meta import LoRAKernelMeta
from kernels.lora_pages import LoRASlotPages
from kernels.lora_shrink import ConfigOverride, _check_meta, _slot_rows
from kernels.utils import FLOAT_DTYPES, cdiv, check_tensor, is_interpreted, next_power_of_2


FEW_SEGMENTS = 16
"""Decode steps with at most this many segments (the meta's num_active: a fixed grid's slot count)
take the segment programs, more take the per-token ones (``lora_expand_silu_mul_config``)."""


@triton.jit(do_not_specialize=["num_active"])   # eager steps vary it: one binary for all
def _lora_expand_silu_mul_kernel(
    buf_ptr, y_ptr, out_ptr, bg_ptr, bu_ptr,
    sorted_token_ids_ptr, active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr, page_table_ptr, slot_ranks_ptr,
    num_tokens, num_active, rank, max_pages, d, cols_per_program,
    stride_buf_slice, stride_buf_split, stride_buf_tok, stride_buf_slot, stride_y_tok, stride_out_tok,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
    MAX_LORAS_PAD: tl.constexpr, PAGE_ROWS: tl.constexpr,
    IDENTITY_PAGES: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Semantics (dtype = y's dtype; B_gate, B_up each [num_pages, d, PAGE_ROWS] contiguous, B[l] slot
    l's rank_l rows of its pages, ``kernels.lora_pages``; buf[s, j, t] read at ``slot(t) *
    stride_buf_slot`` past its strided address, as in ``kernels.lora_expand``; h[s, t] its first rank_l
    columns summed over j):

        for t in range(num_tokens):
          if slot(t) >= 0:
            dg = h[0, t] @ B_gate[slot(t)].T ; du = h[1, t] @ B_up[slot(t)].T
          else:
            dg = du = 0
          g = dtype(y[t, :d] + dg) ; u = dtype(y[t, d:2d] + du)            (fp32 sums)
          out[t] = dtype(dtype(silu(g)) * u)

    Program (m, n) covers columns [n * cols_per_program, (n + 1) * cols_per_program) of d.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_lo = pid_n * cols_per_program
    tok, m_ok, slot, lora_flag, rows_left = _seg_or_base_tile(
        sorted_token_ids_ptr, active_slots_ptr, num_tokens_per_slot_ptr, slot_start_ptr, pid_m, num_tokens,
        num_active, BLOCK_M, MAX_LORAS_PAD)
    if rows_left <= 0:
        return
    zero = slot * 0                                        # slice ids as int32 tensors
    page, sub, r_ok = _slot_rows(page_table_ptr, slot_ranks_ptr, slot, rank, max_pages, BLOCK_R, PAGE_ROWS,
                                 IDENTITY_PAGES)
    h_gate = _tile_h(buf_ptr, zero, slot, lora_flag, tok, m_ok, r_ok, stride_buf_slice, stride_buf_split,
                     stride_buf_tok, stride_buf_slot, BLOCK_M, BLOCK_R, SPLIT_K)        # [BLOCK_M, BLOCK_R]
    h_up = _tile_h(buf_ptr, zero + 1, slot, lora_flag, tok, m_ok, r_ok, stride_buf_slice, stride_buf_split,
                   stride_buf_tok, stride_buf_slot, BLOCK_M, BLOCK_R, SPLIT_K)
    if not UPCAST:
        h_gate = h_gate.to(bg_ptr.dtype.element_ty)
        h_up = h_up.to(bu_ptr.dtype.element_ty)

    y_rows = y_ptr + tok[:, None] * stride_y_tok                                        # [BLOCK_M, 1]
    out_rows = out_ptr + tok[:, None] * stride_out_tok                                  # [BLOCK_M, 1]
    n_end = n_lo + cols_per_program
    for c0 in range(n_lo, tl.minimum(n_end, d), BLOCK_N):
        offs_n = c0 + tl.arange(0, BLOCK_N)
        n_ok = (offs_n < d) & (offs_n < n_end)
        mask = m_ok[:, None] & n_ok[None, :]
        g = tl.load(y_rows + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(y_rows + d + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        # NOTE: on GPUs the native tensor-core dot (h rounded above): measured faster at prefill than tf32.
        g += _tile_delta(h_gate, bg_ptr, page, sub, r_ok, lora_flag, offs_n, n_ok, d, PAGE_ROWS, UPCAST,
                         DOT_PRECISION)
        u += _tile_delta(h_up, bu_ptr, page, sub, r_ok, lora_flag, offs_n, n_ok, d, PAGE_ROWS, UPCAST, DOT_PRECISION)
        _silu_mul_store(g, u, out_rows + offs_n[None, :], mask)


@triton.jit
def _silu_mul_store(g, u, out_ptr, mask):
    """out = dtype(dtype(silu(dtype(g))) * dtype(u)) for fp32 g, u (the unfused pair's roundings)."""
    g = g.to(out_ptr.dtype.element_ty).to(tl.float32)
    u = u.to(out_ptr.dtype.element_ty).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lora_expand_silu_mul_token_kernel(
    buf_ptr, y_ptr, out_ptr, bg_ptr, bu_ptr, token_lora_slots_ptr, page_table_ptr, slot_ranks_ptr,
    rank, max_pages, d, cols_per_program,
    stride_buf_slice, stride_buf_split, stride_buf_tok, stride_buf_slot, stride_y_tok, stride_out_tok,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr, PAGE_ROWS: tl.constexpr,
    IDENTITY_PAGES: tl.constexpr,
    ROUND_TO: tl.constexpr,
):
    """Semantics: as ``_lora_expand_silu_mul_kernel``; program (t, n) covers token t and columns
    [n * cols_per_program, (n + 1) * cols_per_program) of d (a base-model token: plain SiLU-and-mul)."""
    t = tl.program_id(0).to(tl.int64)
    n_lo = tl.program_id(1) * cols_per_program
    slot = tl.load(token_lora_slots_ptr + t)
    zero = slot * 0                                        # slice ids as int32 tensors
    page, sub, r_ok = _slot_rows(page_table_ptr, slot_ranks_ptr, slot, rank, max_pages, BLOCK_R, PAGE_ROWS,
                                 IDENTITY_PAGES)
    h_gate = _token_h(buf_ptr, t, zero, slot, r_ok, stride_buf_slice, stride_buf_split, stride_buf_tok,
                      stride_buf_slot, BLOCK_R, SPLIT_K, ROUND_TO)
    h_up = _token_h(buf_ptr, t, zero + 1, slot, r_ok, stride_buf_slice, stride_buf_split, stride_buf_tok,
                    stride_buf_slot, BLOCK_R, SPLIT_K, ROUND_TO)
    y_row = y_ptr + t * stride_y_tok
    out_row = out_ptr + t * stride_out_tok
    n_end = n_lo + cols_per_program
    for c0 in range(n_lo, tl.minimum(n_end, d), BLOCK_N):
        offs_n = c0 + tl.arange(0, BLOCK_N)
        n_ok = (offs_n < d) & (offs_n < n_end)
        g = tl.load(y_row + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        u = tl.load(y_row + d + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        g += _token_delta(bg_ptr, page, sub, offs_n, n_ok, d, h_gate, r_ok, PAGE_ROWS)
        u += _token_delta(bu_ptr, page, sub, offs_n, n_ok, d, h_up, r_ok, PAGE_ROWS)
        _silu_mul_store(g, u, out_row + offs_n, n_ok)


@functools.lru_cache(maxsize=4096)
def lora_expand_silu_mul_config(num_tokens: int, num_segments: int, d: int, device: torch.device,
                                override: ConfigOverride = ()) -> LoRAExpandConfig:
    """The default launch config, with ``override`` (e.g. ``KernelPolicy.lora_expand``) applied last.

    Decode-sized segments (block_m 16) take the expand's config for the two slices. Longer ones
    take 32 x 128 tiles, two per program: at a 16384-token prefill step (d = 14336) faster on an H200
    than the expand's 64 x 128 x 32 (``benchmarks/RESULTS.md``, "Launch configs and constants inside the
    kernels").
    """
    cfg = lora_expand_config(num_tokens, num_segments, (d, d), device)
    if not is_interpreted(device) and cfg.block_m > 16:
        cfg = LoRAExpandConfig(block_m=32, block_n=128, n_tiles=2, num_warps=4, num_stages=2)
    elif not is_interpreted(device) and num_tokens <= PER_TOKEN_MAX_TOKENS:
        # Decode: segment programs of 128 x 2 columns while at most FEW_SEGMENTS segments can
        # exist, per-token programs of 512 x 2 columns above: on an H200, back to back as in a
        # decode graph (benchmarks/sweeps/lora_decode_sweep.py, 64 and 128 tokens), faster than
        # the wider shapes before them (64 x 4 segment programs, 512 x 4 per-token ones) with 1,
        # 16 and 64 adapters, except level at 128 tokens with 64 (benchmarks/RESULTS.md,
        # lora_fuse_silu_mul).
        cfg = (LoRAExpandConfig(16, 512, 2, 2, 2, per_token=1) if num_segments > FEW_SEGMENTS
               else LoRAExpandConfig(16, 128, 2, 4, 2))
    return dataclasses.replace(cfg, **dict(override))


def lora_expand_silu_mul(buf: torch.Tensor, lora_b_slices: Sequence[torch.Tensor], meta: LoRAKernelMeta,
                         y: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                         config: Optional[LoRAExpandConfig] = None, slot_stride: int = 0,
                         pages: Optional[LoRASlotPages] = None) -> torch.Tensor:
    """SiLU-and-mul of the gate/up projection output with each LoRA token's update added first.

    Args:
        buf: [2, split_k, num_tokens, rank]: ``lora_shrink``'s float32 partials of the gate (slice
            0) and up (slice 1) projections, or every slot's shrink with slot_stride > 0 (as
            ``kernels.lora_expand.lora_expand``'s buf).
        lora_b_slices: (B_gate, B_up) in y's dtype, contiguous: each [num_pages, d, page_rows] with
            ``pages``, [max_loras, d, max_rank] without (as ``kernels.lora_expand.lora_expand``'s).
        meta: this step's ``LoRAKernelMeta``.
        y: [num_tokens, 2 * d] (gate | up), the base GEMM's output; float16/bfloat16/float32, last
            dim contiguous. Not modified.
        out: optional [num_tokens, d] in y's dtype, last dim contiguous.
        config: launch config; None: ``lora_expand_silu_mul_config``'s default.
        slot_stride: see ``kernels.lora_expand.lora_expand``.
        pages: the slots' page table (None: the padded layout), as ``lora_expand``'s.

    Returns:
        out: silu(gate + dg) * (up + du), base-model rows with no update.
    """
    check_tensor("y", y, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, width = y.shape
    if width % 2:
        raise ValueError(f"y: last dim {width} must be even (gate | up).")
    d, dev = width // 2, y.device
    if not isinstance(lora_b_slices, (list, tuple)) or len(lora_b_slices) != 2:
        raise ValueError("lora_b_slices: expected (B_gate, B_up).")
    split_k, rank = check_shrink_output(buf, 2, num_tokens, y, slot_stride)
    _check_meta(meta, num_tokens, meta.max_loras, dev)
    pages = slice_pages(lora_b_slices, meta, pages)
    out_dims = check_b_slices(lora_b_slices, y, pages.page_rows, [0, d])
    if out_dims != (d, d):
        raise ValueError(f"lora_b_slices: widths {out_dims}, expected ({d}, {d}) for y's 2 x {d} columns.")
    if out is None:
        out = torch.empty(num_tokens, d, dtype=y.dtype, device=dev)                    # [T, d]
    check_tensor("out", out, dtypes=(y.dtype,), shape=(num_tokens, d), device=dev, last_dim_contiguous=True)
    if config is None:
        config = lora_expand_silu_mul_config(num_tokens, meta.num_active, d, dev)
    if num_tokens == 0:
        return out
    num_active = 0 if meta.no_lora else meta.num_active
    cols_per_program = config.block_n * config.n_tiles
    if config.per_token:
        block_r = max(16, next_power_of_2(rank))
        _lora_expand_silu_mul_token_kernel[(num_tokens, cdiv(d, cols_per_program))](
            buf, y, out, lora_b_slices[0], lora_b_slices[1], meta.token_lora_slots, pages.page_table,
            pages.slot_ranks, rank, pages.max_pages, d, cols_per_program,
            buf.stride(0), buf.stride(1), buf.stride(2), slot_stride, y.stride(0), out.stride(0),
            BLOCK_N=token_block_n(config.block_n, block_r, config.num_warps), BLOCK_R=block_r, SPLIT_K=split_k,
            PAGE_ROWS=pages.page_rows,
            IDENTITY_PAGES=pages.identity, ROUND_TO=h_round_dtype(y), num_warps=config.num_warps, num_stages=config.num_stages,
        )
        return out
    seg_tiles = num_tokens // config.block_m + num_active
    grid = (seg_tiles + cdiv(num_tokens, config.block_m), cdiv(d, cols_per_program))
    _lora_expand_silu_mul_kernel[grid](
        buf, y, out, lora_b_slices[0], lora_b_slices[1],
        meta.sorted_token_ids, meta.active_slots, meta.num_tokens_per_slot, meta.slot_start, pages.page_table,
        pages.slot_ranks, num_tokens, num_active, rank, pages.max_pages, d, cols_per_program,
        buf.stride(0), buf.stride(1), buf.stride(2), slot_stride, y.stride(0), out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_R=max(16, next_power_of_2(rank)),
        SPLIT_K=split_k, MAX_LORAS_PAD=next_power_of_2(meta.max_loras), PAGE_ROWS=pages.page_rows,
        IDENTITY_PAGES=pages.identity,
        UPCAST=expand_upcast(y), DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
