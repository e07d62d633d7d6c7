"""W4A16 matmul: out = x @ dequant(qweight) (+ bias) with int4 weights dequantized in registers.

For GPTQ, AWQ and compressed-tensors pack-quantized checkpoints: the weight stays packed in
memory (half a byte per weight plus a scale and a zero point per group), so a decode step
reads a quarter of the bf16 weight bytes. As in Marlin, the int4 values are unpacked in
registers next to the tensor-core product; nothing dequantized is ever written to memory.

Layout (the loader converts every checkpoint format to this; K = inputs, N = outputs):

- ``qweight``: int32 [K // 8, N], packed along K: nibble i (bits 4i..4i+3) of qweight[r, n]
  is q[8r + i, n], a value in 0..15 (GPTQ's packing order).
- ``scales``: [K // G, N] in x's dtype (bfloat16 / float16) or float32.
- ``zeros``: [K // G, N], scales' dtype: the zero point in q units (symmetric GPTQ: all 8;
  asymmetric GPTQ / AWQ: any value in 0..15; float, so a fractional zero point works too).
- ``group_size`` G: a power of two >= 16 that divides K, or G == K (one group per column,
  "per-channel"). Act-order (g_idx) checkpoints are permuted along K once at load, so the
  groups here are contiguous.

Semantics: W[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n] and
out[M, N] = x[M, K] @ W (+ bias[N]), float32 accumulation, one rounding to x's dtype at the end.

Two kernels, picked by ``W4A16Config.form``:

- ``_w4a16_kernel`` (TILES, any M): one K step loads the packed [BLOCK_K // 8, BLOCK_N] int32
  tile, repeats each row 8 times and shifts row k by (k % 8) * 4, then subtracts the zero point in
  float32 and rounds (q - z) to x's dtype for tl.dot: exact for integer zero points (GPTQ, AWQ,
  compressed-tensors), so tl.dot sees the exact weights up to their scale. The scale, constant over
  a group of G inputs of a column, is then applied in one of two ways
  (``W4A16Config.scale_in_weight``): to the float32 product of each group (no weight is rounded), or
  to the weight tile before tl.dot, which rounds W to x's dtype as Marlin does but keeps one
  accumulator (the big GEMM tiles: at 128x128 with 8 warps, sm_90 needs 128 registers a thread with
  one accumulator and 222 with two). Per-channel weights (G == K) accumulate x @ (q - z) over all of
  K and scale once at the end. Grid: (M tiles x N tiles, walked GROUP_M rows of tiles at a time for
  L2 reuse) x split_k slices of K.
- ``_w4a16_gemv_kernel`` (GEMV_FMA 1..16 rows, GEMV_DOT 1..64 rows, the decode steps): every packed weight
  is read once by one program (BLOCK_N columns, int32-wide loads along N) over its K slice. The 8
  nibbles of a packed row are 8 slices of K (inputs k0 + i :: 8), each unpacked with one AND into
  the mantissa of 2^23 and one FMA to the float q - z (no int-to-float conversion, no interleaving
  of rows), then multiplied by x elementwise (FMA form) or by tl.dot on a 16-64-row tile; the group
  scale multiplies each step's float32 product (one group per step, or per packed row).

With split_k > 1 each slice writes float32 partials, summed (+ bias) and rounded once either by a
second launch or (``W4A16Config.reduce_in_kernel``) by the last slice of each output tile to finish,
which an int32 arrival counter per tile tells.

Launch configs: ``w4a16_matmul(..., config=W4A16Config(...))`` or field overrides; by default
``w4a16_config(M, N, K, device, override)``: ``SHAPE_DEFAULTS`` (one table of timed launches per
(N, K, token-row bucket), printed by ``benchmarks/sweeps/w4a16_sweep.py``), else ``DECODE_DEFAULTS``
(by token rows) for M <= 16, split-K only where the N tiles leave SMs idle, and GEMM tilings above.

The torch twin is ``w4a16_matmul_ref`` (dequantize to float32, matmul, round once), with the
layout helpers ``pack_int4_along_k``, ``unpack_int4_along_k`` and ``dequantize_w4``;
``tests/kernels/test_kernel_w4a16.py`` compares kernel and twin.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

import triton
import triton.language as tl

from kernels.utils import FLOAT_DTYPES, cdiv, check_tensor, is_interpreted, next_power_of_2, num_sms

PACK_FACTOR = 8
"""int4 values per int32 of ``qweight`` (packed along K)."""

MAX_SUB_K = 128
"""Most inputs one unrolled sub-tile of a K step unpacks (its [sub_k, block_n] tile lives in registers)."""

MAX_SUB_TILES = 4
"""Most sub-tiles one K step unrolls: block_k is clipped to MAX_SUB_TILES * sub_k, which keeps the loop
body, and its compile time, small."""

MAGIC_EXP_BITS = 0x4B000000
"""The exponent bits of 2^23 (float32), which the GEMV ORs into packed words to read nibbles as floats."""

ARRIVAL_COUNTERS = 16384
"""int32 arrival counters per device for ``W4A16Config.reduce_in_kernel``: the most output tiles
one split-K launch reduces in the kernel."""

DEFAULT_NUM_SMS = 132
"""SMs assumed by ``w4a16_config`` when no CUDA device is given (an H100 / H200)."""

W4A16Override = tuple[tuple[str, int], ...]
"""(field, value) pairs of ``W4A16Config`` applied over the default config."""


# ----------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------
@triton.jit
def _load_q_tile(qw_ptr, k0, offs_n, n_ok, K, N, SUB_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """int32 [SUB_K, BLOCK_N] tile of q (values 0..15) for K rows k0 + [0, SUB_K), 0 where masked.

    Loads the packed [SUB_K // 8, BLOCK_N] int32 tile once, repeats each packed row 8 times and
    shifts row k by (k % 8) * 4: row 8r + i of the result is nibble i of packed row r.
    """
    offs_r = k0 // 8 + tl.arange(0, SUB_K // 8)
    packed = tl.load(qw_ptr + offs_r[:, None] * N + offs_n[None, :],
                     mask=(offs_r < K // 8)[:, None] & n_ok[None, :], other=0)          # [SUB_K // 8, BN]
    rows = tl.reshape(tl.broadcast_to(packed[:, None, :], [SUB_K // 8, 8, BLOCK_N]), [SUB_K, BLOCK_N])
    shifts = (tl.arange(0, SUB_K) % 8) * 4                                                # [SUB_K]
    return (rows >> shifts[:, None]) & 0xF


@triton.jit
def _load_group_rows(s_ptr, z_ptr, k0, K, N, offs_n, n_ok, sub_ids, SUB_K: tl.constexpr,
                     GROUP_SIZE: tl.constexpr):
    """float32 (scales, zeros) [SUB_TILES, BLOCK_N] rows of the groups of the K step at k0: row j
    is the group of sub-tile j (inputs k0 + j * SUB_K ...). A sub-tile past K (its x and q are
    all 0) reads the last group's row: a valid address."""
    rows = tl.minimum(k0 + sub_ids * SUB_K, K - 1) // GROUP_SIZE                           # [SUB_TILES]
    offs = rows[:, None] * N + offs_n[None, :]                                             # [SUB_TILES, BN]
    s = tl.load(s_ptr + offs, mask=n_ok[None, :], other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs, mask=n_ok[None, :], other=0.0).to(tl.float32)
    return s, z


@triton.jit
def _store_result(acc, offs_m, m_ok, offs_n, n_ok, split, tile, num_splits, M, N, b_ptr, out_ptr, ws_ptr, cnt_ptr,
                  HAS_BIAS: tl.constexpr, SPLIT_OUT: tl.constexpr, REDUCE_IN_KERNEL: tl.constexpr):
    """Store a program's float32 [BM, BN] result: SPLIT_OUT: ws[split, offs_m, offs_n] = acc; else
    out[offs_m, offs_n] = dtype(acc (+ bias)), rows < M and columns < N only.

    SPLIT_OUT with REDUCE_IN_KERNEL: after its store, the program counts itself into cnt[tile] (an
    acq_rel atomic after a CTA barrier, so the counter's release covers every thread's partial); the
    program that arrives last sums the num_splits partials of its tile (loads that skip L1, which may
    hold stale lines of the workspace), adds the bias, stores out and puts cnt[tile] back to 0 for
    the next launch. No second launch."""
    out_offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]                         # [BM, BN]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_OUT:
        tl.store(ws_ptr + split.to(tl.int64) * M * N + out_offs, acc, mask=out_mask)
        if REDUCE_IN_KERNEL:
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                for other in range(num_splits):
                    if other != split:
                        acc += tl.load(ws_ptr + other * M * N + out_offs, mask=out_mask, other=0.0,
                                       cache_modifier=".cg")
                if HAS_BIAS:
                    acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr,
                  M, N, K, stride_xm, k_tiles_per_split, num_splits,
                  GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_OUT: tl.constexpr,
                  REDUCE_IN_KERNEL: tl.constexpr,
                  SCALE_IN_WEIGHT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
                  GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Semantics (G = GROUP_SIZE, or K when GROUP_SIZE == 0; dtype = out's dtype = x's dtype):

        for m in range(M), n in range(N):
            acc = sum(x[m, k] * (q[k, n] - zeros[k // G, n]) * scales[k // G, n]
                      for k in this program's K slice)                                    # float32
            if SPLIT_OUT: ws[split, m, n] = acc    (summed by the reduce launch or, REDUCE_IN_KERNEL,
                                                    by the tile's last slice: ``_store_result``)
            else:         out[m, n] = dtype(acc + (bias[n] if HAS_BIAS else 0))

    q[k, n] is nibble k % 8 of qweight[k // 8, n]. Program (pid, split) covers the [BLOCK_M,
    BLOCK_N] tile that the GROUP_M-grouped order gives pid, over K tiles [split *
    k_tiles_per_split, (split + 1) * k_tiles_per_split) of BLOCK_K (clipped to K). Each K tile
    is BLOCK_K // SUB_K sub-tiles inside one group each (SUB_K divides G when GROUP_SIZE > 0).
    Per sub-tile, DOT_DTYPE(q - zeros) (exact for integer zero points) goes to tl.dot with x,
    and the scale is applied:

        GROUP_SIZE == 0:  acc += x @ (q - z); acc *= s once after the loop
        SCALE_IN_WEIGHT:  acc += x @ DOT_DTYPE((q - z) * s)     (one accumulator; W rounded)
        else:             acc += (x @ (q - z)) * s              (float32, per sub-tile)

    x rows at stride stride_xm (last dim stride 1); qweight, scales, zeros, out, ws contiguous.
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_m = (pid // pids_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_per_group) % group_rows
    pid_n = (pid % pids_per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm                            # [BM, 1]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N

    k_begin = split * k_tiles_per_split * BLOCK_K
    k_end = tl.minimum(K, k_begin + k_tiles_per_split * BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sub_ids = tl.arange(0, BLOCK_K // SUB_K)
    if GROUP_SIZE == 0:
        s = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)                  # [BN]
        z = tl.load(z_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)                  # [BN]
    else:
        s_next, z_next = _load_group_rows(s_ptr, z_ptr, k_begin, K, N, offs_n, n_ok, sub_ids, SUB_K,
                                          GROUP_SIZE)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if GROUP_SIZE != 0:
            # NOTE: the next step's scale / zero rows are loaded a step ahead (register prefetch): the
            # pipeliner stages only the x and q tiles, and these rows come from HBM with the weights.
            s_cur, z_cur = s_next, z_next                                                 # [SUB_TILES, BN]
            s_next, z_next = _load_group_rows(s_ptr, z_ptr, k0 + BLOCK_K, K, N, offs_n, n_ok, sub_ids, SUB_K,
                                              GROUP_SIZE)
        for j in tl.static_range(BLOCK_K // SUB_K):
            ks = k0 + j * SUB_K
            offs_k = ks + tl.arange(0, SUB_K)
            xa = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
            q = _load_q_tile(qw_ptr, ks, offs_n, n_ok, K, N, SUB_K, BLOCK_N)               # [SUB_K, BN]
            if GROUP_SIZE != 0:
                s = tl.sum(tl.where(sub_ids[:, None] == j, s_cur, 0.0), axis=0)            # [BN]
                z = tl.sum(tl.where(sub_ids[:, None] == j, z_cur, 0.0), axis=0)            # [BN]
            w = q.to(tl.float32) - z[None, :]                                              # [SUB_K, BN]
            if GROUP_SIZE == 0:
                acc = tl.dot(xa.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
            elif SCALE_IN_WEIGHT:
                w = (w * s[None, :]).to(DOT_DTYPE)
                acc = tl.dot(xa.to(DOT_DTYPE), w, acc, input_precision=DOT_PRECISION)
            else:
                prod = tl.dot(xa.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)  # [BM, BN]
                acc += prod * s[None, :]
    if GROUP_SIZE == 0:
        acc = acc * s[None, :]

    _store_result(acc, offs_m, m_ok, offs_n, n_ok, split, pid, num_splits, M, N, b_ptr, out_ptr, ws_ptr, cnt_ptr,
                  HAS_BIAS, SPLIT_OUT, REDUCE_IN_KERNEL)


@triton.jit
def _nibble_minus_zero(words, c8, c12, c16, I: tl.constexpr):
    """float32 q - z of nibble I of every packed int32, without an int-to-float conversion.

    ``words`` (``_magic_words``) hold every nibble at bit B = 8, 12 or 16 inside the mantissa of 2^23
    (nibble 0 of word 0 at 8, 1 at 12; 2, 3, 4 of word 1 at 8, 12, 16; 5, 6, 7 of word 2 at 8, 12, 16):
    one AND keeps the exponent and that nibble, which read as a float are 2^23 + q 2^B, and one FMA
    with cB = -(2^(23 - B) + z) gives (2^23 + q 2^B) 2^-B + cB = q - z: exact for integer zero points,
    a fractional one rounded to 2^-B (at most 2^-9 of a q step)."""
    if I == 0 or I == 1:
        w = words[0]
    elif I <= 4:
        w = words[1]
    else:
        w = words[2]
    if I == 0 or I == 2 or I == 5:
        return (w & 0x4B000F00).to(tl.float32, bitcast=True) * 0.00390625 + c8               # 2^-8
    elif I == 1 or I == 3 or I == 6:
        return (w & 0x4B00F000).to(tl.float32, bitcast=True) * 0.000244140625 + c12          # 2^-12
    else:
        return (w & 0x4B0F0000).to(tl.float32, bitcast=True) * 0.0000152587890625 + c16      # 2^-16


@triton.jit
def _magic_words(packed, exp_bits):
    """``_nibble_minus_zero``'s words of packed int32: (packed << 8, packed, packed >> 12 (logical)), each
    with the bits of 2^23's exponent (``exp_bits`` = 0x4B000000) set; the other bits above 19 are cleared by
    the nibble's AND, so no mask here (one OR, the shifted words one shift more).
    NOTE: ``exp_bits`` is a kernel argument, not a literal: with a constant, LLVM rewrites each nibble's
    (word | C) & mask into (word & mask) | C, which costs a register move of C and a second LOP3 per
    nibble in sm_90 SASS instead of one OR per word."""
    hi = (packed.to(tl.uint32, bitcast=True) >> 12).to(tl.int32, bitcast=True)
    return (packed << 8) | exp_bits, packed | exp_bits, hi | exp_bits


@triton.jit
def _load_x_pair(x_rows, x32_rows, x_cols, x_mask, k0, J: tl.constexpr, X_PAIRS: tl.constexpr,
                 MASK_X: tl.constexpr):
    """float32 (x[:, k0 + x_cols + 2 J], x[:, k0 + x_cols + 2 J + 1]) (x_cols = 8 r): with X_PAIRS
    (bfloat16 x, 4-byte aligned rows) one int32 load of both (a bf16 is the top half of a float32),
    else two loads. MASK_X: x_mask (rows < M, inputs < the slice's end), else no mask."""
    if X_PAIRS:
        ptr = x32_rows + (k0 + x_cols + 2 * J) // 2
        if MASK_X:
            v = tl.load(ptr, mask=x_mask, other=0)
        else:
            v = tl.load(ptr)
        return (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)
    ptr = x_rows + (k0 + x_cols + 2 * J)
    if MASK_X:
        lo = tl.load(ptr, mask=x_mask, other=0.0)
        hi = tl.load(ptr + 1, mask=x_mask, other=0.0)
    else:
        lo = tl.load(ptr)
        hi = tl.load(ptr + 1)
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def _load_gemv_step(qw_ptr, s_ptr, z_ptr, k0, k_end, N, rows_off, cols, col_ok, GROUP_SIZE: tl.constexpr,
                    SCALE_ROWS: tl.constexpr):
    """The K step at k0 of ``_w4a16_gemv_kernel``: the packed int32 tile (0 past k_end or N) and its
    groups' float32 scales and zeros, shaped by broadcasting ``rows_off`` (packed rows from k0 // 8) with
    ``cols`` / ``col_ok`` (columns): per packed row with SCALE_ROWS, else one row (the step lies in one
    group; per-channel: zeros, unused)."""
    rows = k0 // 8 + rows_off
    row_ok = rows < k_end // 8
    packed = tl.load(qw_ptr + rows * N + cols, mask=row_ok & col_ok, other=0)
    if GROUP_SIZE == 0:
        s = tl.zeros_like(cols).to(tl.float32)
        z = s
    elif SCALE_ROWS:
        offs = (rows * 8) // GROUP_SIZE * N + cols
        s = tl.load(s_ptr + offs, mask=row_ok & col_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs, mask=row_ok & col_ok, other=0.0).to(tl.float32)
    else:
        g = tl.minimum(k0, k_end - 1) // GROUP_SIZE
        s = tl.load(s_ptr + g * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * N + cols, mask=col_ok, other=0.0).to(tl.float32)
    return packed, s, z


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr,
                       M, N, K, stride_xm, k_steps_per_split, num_splits, exp_bits,
                       GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_OUT: tl.constexpr,
                       REDUCE_IN_KERNEL: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_DOT: tl.constexpr, X_PAIRS: tl.constexpr, MASK_X: tl.constexpr,
                       DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Semantics (G = GROUP_SIZE, or K when GROUP_SIZE == 0; dtype = out's dtype = x's dtype), the same
    as ``_w4a16_kernel``'s:

        for m in range(M), n in range(N):
            acc = sum(x[m, k] * (q[k, n] - zeros[k // G, n]) * scales[k // G, n]
                      for k in this program's K slice)                                    # float32
            if SPLIT_OUT: ws[split, m, n] = acc    (summed by the reduce launch or, REDUCE_IN_KERNEL,
                                                    by the tile's last slice: ``_store_result``)
            else:         out[m, n] = dtype(acc + (bias[n] if HAS_BIAS else 0))

    The decode GEMV (M <= BLOCK_M: up to 16 rows in the FMA form, 64 with tl.dot): program (pid, split) owns columns [pid * BLOCK_N, (pid + 1) *
    BLOCK_N) of all M rows over K steps [split * k_steps_per_split, (split + 1) * k_steps_per_split) of
    BLOCK_K inputs (clipped to K), so every packed weight is read once, BLOCK_N int32 (4 BLOCK_N bytes)
    wide per packed row; the next step's packed tile and scales are loaded before this step is computed
    (register prefetch). Nibble i of packed row r is input k0 + 8 r + i: the step is computed as 8 [R =
    BLOCK_K // 8, BLOCK_N] slices, slice i against x[:, k0 + i :: 8] (``_unpack_nibble``: float q with no
    int-to-float conversion). The zero point and scale leave the inner product: per packed row r of a
    group, sum_k x (q - z) s = s (sum_k x q - z sum_k x), so a weight costs one mask, one FMA to q and
    one FMA per row (USE_DOT=0: products summed elementwise into a [BLOCK_M, R, BLOCK_N] float32
    accumulator in the packed tile's register layout, reduced over R once at the end) or its share of a
    tl.dot on the [BLOCK_M = 16, R] x slice (USE_DOT=1, q exact in DOT_DTYPE; needs R >= 16 and a step
    inside one group). A step over several groups (BLOCK_K > G, USE_DOT=0) scales per packed row.
    x rows at stride stride_xm (last dim stride 1); qweight, scales, zeros, out, ws contiguous.
    """
    SCALE_ROWS: tl.constexpr = GROUP_SIZE != 0 and BLOCK_K > GROUP_SIZE
    R: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    x_m = tl.minimum(offs_m, M - 1).to(tl.int64)           # rows past M read row M - 1 (never stored)
    offs_r = tl.arange(0, R)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_begin = split * k_steps_per_split * BLOCK_K
    k_end = tl.minimum(K, k_begin + k_steps_per_split * BLOCK_K)
    # The FMA form works on [BLOCK_M, R, BLOCK_N] tensors (the packed tile [1, R, BLOCK_N]), so the
    # products stay in the layout the tile was loaded in; the tl.dot form on 2-D tiles.
    if USE_DOT:
        rows_off = offs_r[:, None]                                                       # [R, 1]
        cols = offs_n[None, :]                                                           # [1, BN]
        col_ok = n_ok[None, :]
        x_row_offs = x_m[:, None] * stride_xm                                            # [BM, 1]
        x_cols = 8 * offs_r[None, :]                                                     # [1, R]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        rows_off = offs_r[None, :, None]                                                 # [1, R, 1]
        cols = offs_n[None, None, :]                                                     # [1, 1, BN]
        col_ok = n_ok[None, None, :]
        x_row_offs = x_m[:, None, None] * stride_xm                                      # [BM, 1, 1]
        x_cols = 8 * rows_off                                                            # [1, R, 1]
        acc = tl.zeros([BLOCK_M, R, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + x_row_offs
    x32_rows = x_ptr.to(tl.pointer_type(tl.int32)) + x_row_offs // 2                     # bf16 pairs
    packed_next, s_next, z_next = _load_gemv_step(qw_ptr, s_ptr, z_ptr, k_begin, k_end, N, rows_off, cols, col_ok,
                                                  GROUP_SIZE, SCALE_ROWS)
    if GROUP_SIZE == 0:
        s = tl.load(s_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if GROUP_SIZE == 0:
            packed = packed_next
        else:
            packed, s, z = packed_next, s_next, z_next
        packed_next, s_next, z_next = _load_gemv_step(qw_ptr, s_ptr, z_ptr, k0 + BLOCK_K, k_end, N, rows_off,
                                                      cols, col_ok, GROUP_SIZE, SCALE_ROWS)
        words = _magic_words(packed, exp_bits)
        c8, c12, c16 = -(z + 32768.0), -(z + 2048.0), -(z + 128.0)
        x_mask = k0 + x_cols < k_end                                                     # [1, R(, 1)]
        if USE_DOT:
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        else:
            part = tl.zeros([BLOCK_M, R, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(4):
            x_lo, x_hi = _load_x_pair(x_rows, x32_rows, x_cols, x_mask, k0, j, X_PAIRS, MASK_X)   # [BM, R(, 1)]
            w_lo = _nibble_minus_zero(words, c8, c12, c16, 2 * j)                         # [(1, )R, BN]
            w_hi = _nibble_minus_zero(words, c8, c12, c16, 2 * j + 1)
            if USE_DOT:
                part = tl.dot(x_lo.to(DOT_DTYPE), w_lo.to(DOT_DTYPE), part, input_precision=DOT_PRECISION)
                part = tl.dot(x_hi.to(DOT_DTYPE), w_hi.to(DOT_DTYPE), part, input_precision=DOT_PRECISION)
            else:
                part += x_lo * w_lo
                part += x_hi * w_hi
        if GROUP_SIZE == 0:
            acc += part
        else:
            acc += s * part
    if GROUP_SIZE == 0:
        acc = acc * s
    if not USE_DOT:
        acc = tl.sum(acc, axis=1)                                                        # [BM, BN]

    _store_result(acc, offs_m, m_ok, offs_n, n_ok, split, pid_n, num_splits, M, N, b_ptr, out_ptr, ws_ptr, cnt_ptr,
                  HAS_BIAS, SPLIT_OUT, REDUCE_IN_KERNEL)


@triton.jit
def _split_k_reduce_kernel(ws_ptr, b_ptr, out_ptr, num_elements, N, num_splits,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Semantics: for i in range(M * N): out.flat[i] = dtype(sum(ws[s].flat[i] for s in
    range(num_splits)) + (bias[i % N] if HAS_BIAS else 0)); ws float32 [num_splits, M, N]."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_elements
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(num_splits):
        acc += tl.load(ws_ptr + s * num_elements + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------------
# Launch configs
# ----------------------------------------------------------------------------------------
def _check_pow2(name: str, value: object, min_value: int, max_value: int) -> None:
    if (isinstance(value, bool) or not isinstance(value, int) or not min_value <= value <= max_value
            or value & (value - 1)):
        raise ValueError(f"W4A16Config.{name}: {value!r} must be a power of two in "
                         f"[{min_value}, {max_value}].")


TILES, GEMV_FMA, GEMV_DOT = 0, 1, 2
"""``W4A16Config.form`` values: the tiled kernel (``_w4a16_kernel``, any M), the decode GEMV
(``_w4a16_gemv_kernel``, M <= ``GEMV_MAX_ROWS``) with elementwise FMAs, or with tl.dot (M <=
``GEMV_DOT_MAX_ROWS``)."""

GEMV_MAX_ROWS = 16
"""Most token rows the GEMV's FMA form takes, and the decode rows of ``DECODE_DEFAULTS`` (more run the
tiled kernel, or the tl.dot form up to GEMV_DOT_MAX_ROWS)."""

GEMV_DOT_MAX_ROWS = 64
"""Most token rows the GEMV's tl.dot form takes: one program holds all rows, so each packed weight is
still read and unpacked once (the unpack's cost does not grow with the rows; at 64 rows 8.6 sm_90
instructions a weight in the K loop against 9.8 for the tiled kernel's 64 x 64 tile)."""

MIN_DOT_BLOCK_K = 128
"""Smallest block_k of the GEMV's tl.dot form: tl.dot needs >= 16 packed rows (8 inputs each)."""

FMA_FALLBACK_ROWS = 4
"""Most rows GEMV_DOT on groups < MIN_DOT_BLOCK_K inputs runs as GEMV_FMA (whose registers grow with the
rows); more run the tiled kernel."""


@dataclass(frozen=True)
class W4A16Config:
    """Launch parameters of the W4A16 matmul."""

    block_m: int = 16
    """Tiled form: token rows per program (tl.dot needs >= 16). Power of two in [16, 256]. The GEMV
    forms take next_power_of_2(M) rows (FMA) or 16 (tl.dot)."""
    block_n: int = 32
    """Output columns per program. Power of two in [16, 256]."""
    block_k: int = 256
    """Inputs per K step. Power of two in [16, 4096]. Tiled form: each step is unrolled into sub-tiles of
    sub_k = min(block_k, G, MAX_SUB_K) inputs (inside one group each; per-channel: min(block_k,
    MAX_SUB_K)), and block_k is clipped to MAX_SUB_TILES * sub_k. GEMV forms: block_k // 8 packed rows
    per step; the tl.dot form clips it to G (grouped) and needs >= MIN_DOT_BLOCK_K after that."""
    split_k: int = 1
    """Slices of K computed by separate programs (float32 partials summed by a second launch).
    Power of two in [1, 64]; fewer when K has fewer block_k steps."""
    group_m: int = 8
    """Tiled form: rows of M tiles walked together (tiles of one weight column block reuse it from L2).
    Int in [1, 64]."""
    num_warps: int = 4
    """Warps per program (power of two in [1, 16])."""
    num_stages: int = 3
    """Software-pipelining depth of the K loop (>= 1)."""
    scale_in_weight: int = 0
    """Tiled form, grouped weights only. 1: the scale multiplies the weight tile before tl.dot (W rounded
    to x's dtype, as Marlin; one accumulator, for the big GEMM tiles); 0: the product of each group
    is scaled in float32 (a second [block_m, block_n] accumulator). Per-channel weights always
    scale once at the end."""
    reduce_in_kernel: int = 0
    """With more than one K slice: 1: the last slice of each output tile to finish sums the float32
    partials (an int32 arrival counter per tile, one launch); 0: a second launch sums them. Falls back
    to 0 when the output tiles outnumber ``ARRIVAL_COUNTERS``."""
    form: int = TILES
    """TILES (0), GEMV_FMA (1) or GEMV_DOT (2). GEMV_FMA with more than GEMV_MAX_ROWS rows, GEMV_DOT with
    more than GEMV_DOT_MAX_ROWS, run the tiled kernel; GEMV_DOT whose step has fewer than MIN_DOT_BLOCK_K
    inputs (groups or block_k below it) runs GEMV_FMA up to FMA_FALLBACK_ROWS rows and the tiled kernel
    (this block_m, block_n, block_k, split_k) above."""

    def __post_init__(self) -> None:
        for name, values in (("scale_in_weight", (0, 1)), ("reduce_in_kernel", (0, 1)),
                             ("form", (TILES, GEMV_FMA, GEMV_DOT))):
            value = getattr(self, name)
            if value not in values or isinstance(value, (bool, float)):
                raise ValueError(f"W4A16Config.{name}: {value!r} must be one of {values}.")
        _check_pow2("block_m", self.block_m, 16, 256)
        _check_pow2("block_n", self.block_n, 16, 256)
        _check_pow2("block_k", self.block_k, 16, 4096)
        _check_pow2("split_k", self.split_k, 1, 64)
        _check_pow2("num_warps", self.num_warps, 1, 16)
        for name, low, high in (("group_m", 1, 64), ("num_stages", 1, 8)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"W4A16Config.{name}: {value!r} must be an int in [{low}, {high}].")


@dataclass(frozen=True)
class DecodeDefault:
    """One row of ``DECODE_DEFAULTS``: the GEMV launch for up to ``max_rows`` token rows."""

    max_rows: int
    """Serves M <= max_rows (and more than the previous row's max_rows)."""
    config: W4A16Config
    """The launch (its split_k is replaced by the fill rule below)."""
    programs_per_sm: int
    """Fill rule: split_k doubles (up to ``max_split_k``) while cdiv(N, block_n) * split_k programs are
    fewer than programs_per_sm * SMs and every slice keeps >= ``min_steps_per_split`` K steps."""
    max_split_k: int = 8
    """Most K slices (each one more float32 partial per output for the reduce launch)."""
    min_steps_per_split: int = 2
    """Fewest block_k steps a K slice keeps (the register prefetch needs a next step to overlap)."""


DECODE_DEFAULTS: tuple[DecodeDefault, ...] = (
    DecodeDefault(2, W4A16Config(form=GEMV_FMA, block_n=64, block_k=128, num_warps=4, num_stages=1), 4, 16),
    DecodeDefault(GEMV_MAX_ROWS, W4A16Config(form=GEMV_DOT, block_n=64, block_k=128, num_warps=4, num_stages=1),
                  4, 16),
)
"""The decode launches ``w4a16_config`` picks for shapes ``SHAPE_DEFAULTS`` does not list, by token rows
(the first row with M <= max_rows); split-K reduced by a second launch.
Chosen from the kernel's structure and its sm_90 SASS: per weight the FMA form costs one AND, one FMA to
q - z and one FMA per row (in the K loop 5.0 instructions a weight at one row, 6.6 at two, 9.7 at four),
the tl.dot form 6.0 at any M <= 16, so FMA up to 2 rows and tl.dot above. At 5 instructions a weight the
132 SMs (4 warp instructions a clock each, 1.98 GHz) get through about 6.7e12 weights/s, 0.70 of the H200's
4.8 TB/s of int4 bytes: the one-row GEMV is issue-bound at about 1.4x its bytes floor at best. block_n 64
(at 128 columns, or 64 with 2 warps, the compiler moves every product through shared memory), 128 inputs a
step (one group of 128), and split-K until about 4 programs per SM keep weight loads in flight. How these
rows compare with ``SHAPE_DEFAULTS`` on the H200: ``benchmarks/RESULTS.md``, "Quantized weights"."""


@dataclass(frozen=True)
class ShapeDefault:
    """One row of ``SHAPE_DEFAULTS``: the launch of one weight shape for up to ``max_rows`` token rows."""

    n: int
    """Output columns N of the weight."""
    k: int
    """Inputs K of the weight."""
    max_rows: int
    """Serves M <= max_rows (and more than the shape's previous row's max_rows)."""
    config: W4A16Config
    """The launch, as timed (split_k included)."""


SHAPE_DEFAULTS: tuple[ShapeDefault, ...] = (
    # o: 8.3 us, cuBLAS 12.7
    ShapeDefault(4096, 4096, 1, W4A16Config(
        block_k=512, split_k=2, num_warps=8, num_stages=1, reduce_in_kernel=1, form=1)),
    # o: 11.7 us, cuBLAS 12.5
    ShapeDefault(4096, 4096, 4, W4A16Config(block_n=128, block_k=128, split_k=8, num_warps=8, num_stages=1, form=2)),
    # o: 14.6 us, cuBLAS 12.8
    ShapeDefault(4096, 4096, 16, W4A16Config(block_n=64, block_k=128, split_k=8, num_stages=4, scale_in_weight=1)),
    # o: 16.9 us, cuBLAS 12.0
    ShapeDefault(4096, 4096, 64, W4A16Config(
        block_m=64, block_n=64, block_k=128, split_k=4, num_stages=4, scale_in_weight=1)),
    # down: 18.9 us, cuBLAS 31.4
    ShapeDefault(4096, 14336, 1, W4A16Config(
        block_k=512, split_k=2, num_warps=8, num_stages=1, reduce_in_kernel=1, form=1)),
    # down: 29.4 us, cuBLAS 31.7
    ShapeDefault(4096, 14336, 4, W4A16Config(block_n=128, block_k=128, split_k=8, num_warps=8, num_stages=1, form=2)),
    # down: 36.6 us, cuBLAS 32.2
    ShapeDefault(4096, 14336, 16, W4A16Config(block_n=128, block_k=128, split_k=8, scale_in_weight=1)),
    # down: 40.8 us, cuBLAS 35.6
    ShapeDefault(4096, 14336, 64, W4A16Config(block_m=64, block_n=128, block_k=128, split_k=8, scale_in_weight=1)),
    # qkv: 9.9 us, cuBLAS 15.2
    ShapeDefault(6144, 4096, 1, W4A16Config(block_n=16, block_k=512, num_stages=1, form=1)),
    # qkv: 16.6 us, cuBLAS 15.5
    ShapeDefault(6144, 4096, 4, W4A16Config(
        block_n=64, block_k=128, split_k=4, num_stages=1, reduce_in_kernel=1, form=1)),
    # qkv: 18.5 us, cuBLAS 15.7
    ShapeDefault(6144, 4096, 16, W4A16Config(block_n=128, block_k=128, split_k=8, scale_in_weight=1)),
    # qkv: 22.9 us, cuBLAS 16.5
    ShapeDefault(6144, 4096, 64, W4A16Config(
        block_m=64, block_n=128, block_k=64, split_k=8, num_stages=4, scale_in_weight=1)),
    # gate_up: 30.4 us, cuBLAS 60.2
    ShapeDefault(28672, 4096, 1, W4A16Config(block_k=512, num_warps=8, num_stages=1, form=1)),
    # gate_up: 57.6 us, cuBLAS 59.8
    ShapeDefault(28672, 4096, 4, W4A16Config(block_n=64, block_k=128, split_k=2, num_stages=1, form=1)),
    # gate_up: 60.9 us, cuBLAS 60.3
    ShapeDefault(28672, 4096, 16, W4A16Config(block_n=128, block_k=128, split_k=4, scale_in_weight=1)),
    # gate_up: 78.9 us, cuBLAS 65.2
    ShapeDefault(28672, 4096, 64, W4A16Config(block_m=64, block_n=128, block_k=128, scale_in_weight=1)),
)
"""Per-shape launches, one row per (N, K, token-row bucket), consulted before the rules below: the table
``benchmarks/sweeps/w4a16_sweep.py`` prints (the fastest config of each Llama-3-8B projection at M = 1,
4, 16, 64 on an H200, group size 128; each row's time and cuBLAS bf16's in its comment). A shape or M it
does not list takes ``DECODE_DEFAULTS`` (M <= 16) or the GEMM tilings."""


def _shape_default(M: int, N: int, K: int) -> Optional[W4A16Config]:
    """The ``SHAPE_DEFAULTS`` config of the smallest bucket of (N, K) with M <= max_rows, or None."""
    rows = [r for r in SHAPE_DEFAULTS if r.n == N and r.k == K and M <= r.max_rows]
    return min(rows, key=lambda r: r.max_rows).config if rows else None


def w4a16_config(M: int, N: int, K: int, device: Optional[torch.device] = None,
                 override: W4A16Override = ()) -> W4A16Config:
    """The default config for x [M, K] @ W [K, N], with ``override`` applied last.

    Args:
        M, N, K: token rows, output columns, inputs per row.
        device: where it runs; a CPU device means the interpreter (small, quick tiles). None: a
            CUDA device with ``DEFAULT_NUM_SMS`` SMs.
        override: ``W4A16Config`` (field, value) pairs; ValueError for an unknown field or a
            value the config rejects.

    Tilings: a (N, K, M) that ``SHAPE_DEFAULTS`` lists takes its row (on CUDA). Else M <= GEMV_MAX_ROWS
    is the decode GEMV (``DECODE_DEFAULTS``: every packed weight read
    once, split-K only where the N tiles leave SMs idle). M > 16: GEMM tiles (block_m up to 64,
    then 64x128, then 128x128 with 8 warps above 256 rows) with the scale folded into the weight
    tile (scale_in_weight=1: one accumulator, fewer registers).
    NOTE: the GEMM tiles are first choices, checked to compile for sm_90 without spills, untuned;
    ``benchmarks/sweeps/w4a16_sweep.py`` times them against the alternatives on the GPU.
    """
    if device is not None and is_interpreted(device):
        if M <= GEMV_MAX_ROWS:
            cfg = W4A16Config(form=GEMV_FMA, block_n=min(32, max(16, next_power_of_2(N))),
                              block_k=min(64, max(16, next_power_of_2(K))), num_stages=1)
        else:
            cfg = W4A16Config(block_m=16, block_n=min(32, max(16, next_power_of_2(N))),
                              block_k=min(64, max(16, next_power_of_2(K))), num_stages=1)
    elif _shape_default(M, N, K) is not None:
        cfg = _shape_default(M, N, K)
    elif M <= GEMV_MAX_ROWS:
        row = next(r for r in DECODE_DEFAULTS if M <= r.max_rows)
        sms = num_sms(device) if device is not None else DEFAULT_NUM_SMS
        n_tiles, k_steps = cdiv(N, row.config.block_n), cdiv(K, row.config.block_k)
        split_k = 1
        while (n_tiles * split_k < row.programs_per_sm * sms and split_k < row.max_split_k
               and k_steps >= 2 * split_k * row.min_steps_per_split):
            split_k *= 2
        cfg = dataclasses.replace(row.config, split_k=split_k)
    elif M <= 64:
        cfg = W4A16Config(block_m=min(64, next_power_of_2(M)), block_n=64, block_k=128, num_warps=4,
                          num_stages=4, scale_in_weight=1)
    elif M <= 256:
        cfg = W4A16Config(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4, scale_in_weight=1)
    else:
        cfg = W4A16Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, scale_in_weight=1)
    if not override:
        return cfg
    fields = dict(override)
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(W4A16Config)})
    if unknown:
        raise ValueError(f"W4A16 config override: unknown field(s) {unknown}; use "
                         f"{', '.join(f.name for f in dataclasses.fields(W4A16Config))}.")
    return dataclasses.replace(cfg, **fields)


# ----------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------
def _check_group_size(group_size: object, K: int) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size: expected a host int, got {type(group_size).__name__}.")
    if group_size != K and (group_size < 16 or group_size & (group_size - 1) or K % group_size):
        raise ValueError(f"group_size: {group_size} must be K ({K}, per-channel) or a power of two >= 16 "
                         f"that divides K.")
    return group_size


def _check_inputs(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int, bias: Optional[torch.Tensor], config: Optional[W4A16Config]) -> int:
    """Check every argument against the layout in the module docstring; returns N."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    K = x.shape[1]
    if K < PACK_FACTOR or K % PACK_FACTOR:
        raise ValueError(f"x: K = {K} inputs must be a positive multiple of {PACK_FACTOR} "
                         f"(int4 packed 8 per int32).")
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,), device=x.device, contiguous=True)
    check_tensor("qweight", qweight, shape=(K // PACK_FACTOR, None))
    N = qweight.shape[1]
    if N < 1:
        raise ValueError(f"qweight: shape {tuple(qweight.shape)} must have N >= 1 columns.")
    G = _check_group_size(group_size, K)
    check_tensor("scales", scales, dtypes=(x.dtype, torch.float32), shape=(K // G, N), device=x.device,
                 contiguous=True)
    check_tensor("zeros", zeros, dtypes=(scales.dtype,), shape=(K // G, N), device=x.device, contiguous=True)
    if bias is not None:
        check_tensor("bias", bias, dtypes=(x.dtype,), shape=(N,), device=x.device, contiguous=True)
    if config is not None and not isinstance(config, W4A16Config):
        raise ValueError(f"config: expected a W4A16Config, got {type(config).__name__}.")
    return N


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: Optional[torch.Tensor] = None,
                 config: Optional[W4A16Config] = None, *, override: W4A16Override = ()) -> torch.Tensor:
    """out = x @ W (+ bias), W the int4 weight of the module docstring's layout, float32 accumulation.

    Args:
        x: [M, K] float16 / bfloat16 / float32, last dim contiguous (row stride free); K a
            multiple of 8.
        qweight: int32 [K // 8, N], contiguous: nibble i of qweight[r, n] is q[8r + i, n].
        scales: [K // G, N] in x's dtype or float32, contiguous.
        zeros: [K // G, N] in scales' dtype, contiguous (zero points in q units).
        group_size: G, K (per-channel) or a power of two >= 16 that divides K.
        bias: optional [N] in x's dtype, contiguous; added in float32 before the final rounding.
        config: launch config; None: ``w4a16_config(M, N, K, x.device, override)``.
        override: ``W4A16Config`` field overrides of the default config (ignored with ``config``).

    Returns:
        out: a new contiguous [M, N] tensor in x's dtype.
    """
    N = _check_inputs(x, qweight, scales, zeros, group_size, bias, config)
    M, K = x.shape
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)                              # [M, N]
    if M == 0:
        return out
    if config is None:
        config = w4a16_config(M, N, K, x.device, override)
    gemv_form = _gemv_form(config, M, K, group_size)
    if gemv_form is not None:
        _launch_gemv(x, qweight, scales, zeros, group_size, bias, config, gemv_form, out)
        return out
    if config.form != TILES:
        config = dataclasses.replace(config, form=TILES)
    per_channel = group_size == K
    # Sub-tiles of one group each (any size for one group over K); sub_k divides block_k.
    sub_k = min(config.block_k, MAX_SUB_K if per_channel else min(group_size, MAX_SUB_K))
    block_k = min(config.block_k, MAX_SUB_TILES * sub_k)
    tiles = cdiv(M, config.block_m) * cdiv(N, config.block_n)
    plan = _plan_splits(cdiv(K, block_k), config, tiles, out)
    dot_dtype, dot_precision = _dot_types(x)
    _w4a16_kernel[(tiles, plan.num_splits)](
        x, qweight, scales, zeros, bias if bias is not None else scales, out, plan.ws, plan.counters,
        M, N, K, x.stride(0), plan.steps_per_split, plan.num_splits,
        GROUP_SIZE=0 if per_channel else group_size, HAS_BIAS=bias is not None, SPLIT_OUT=plan.num_splits > 1,
        REDUCE_IN_KERNEL=plan.in_kernel, SCALE_IN_WEIGHT=bool(config.scale_in_weight),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, SUB_K=sub_k, GROUP_M=config.group_m,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision,
        num_warps=config.num_warps, num_stages=config.num_stages)
    _finish_splits(plan, bias, out)
    return out


@dataclass
class SplitPlan:
    """How one launch splits K (``_plan_splits``)."""

    steps_per_split: int
    """block_k steps per K slice."""
    num_splits: int
    """K slices (programs along the grid's second axis), none empty."""
    ws: torch.Tensor
    """float32 [num_splits, M, N] partials when num_splits > 1, else ``out`` itself (unused)."""
    counters: torch.Tensor
    """int32 [ARRIVAL_COUNTERS] arrival counters, all 0 (``_arrival_counters``) with ``in_kernel``, else
    ``ws`` (unused)."""
    in_kernel: bool
    """The kernel reduces the partials itself (else ``_reduce_splits`` runs after it)."""


_COUNTERS: dict[tuple[str, Optional[int]], torch.Tensor] = {}
"""Registry of the zeroed int32 [ARRIVAL_COUNTERS] per device of the in-kernel split-K reduction; every
launch leaves its counters at 0.
NOTE: one set per device, so two launches that run at the same time on different streams must not both
reduce in the kernel (the engine's forward runs on one stream)."""


def _arrival_counters(device: torch.device) -> Optional[torch.Tensor]:
    """This device's counters, allocated and zeroed on first use and kept for the process (a CUDA graph that
    captured a launch holds their address); None on a first use inside a CUDA graph capture, where the
    zeroing would only run at replay (that launch reduces with a second launch instead)."""
    key = (device.type, device.index)
    if key not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _COUNTERS[key] = torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)   # [ARRIVAL_COUNTERS]
    return _COUNTERS[key]


def _plan_splits(k_steps: int, config: W4A16Config, tiles: int, out: torch.Tensor) -> SplitPlan:
    """At most config.split_k K slices of k_steps, none empty; their workspace; the in-kernel reduction
    when config.reduce_in_kernel asks for it, the ``tiles`` output tiles fit ``ARRIVAL_COUNTERS`` and the
    device's counters exist (``_arrival_counters``)."""
    per_split = cdiv(k_steps, config.split_k)
    num_splits = cdiv(k_steps, per_split)
    if num_splits == 1:
        return SplitPlan(per_split, 1, out, out, False)
    ws = torch.empty(num_splits, *out.shape, dtype=torch.float32, device=out.device)        # [splits, M, N]
    counters = (_arrival_counters(out.device) if config.reduce_in_kernel and tiles <= ARRIVAL_COUNTERS
                else None)
    return SplitPlan(per_split, num_splits, ws, ws if counters is None else counters, counters is not None)


def _finish_splits(plan: SplitPlan, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """The second launch of a split-K call that the kernel did not reduce."""
    if plan.num_splits > 1 and not plan.in_kernel:
        _reduce_splits(plan.ws, bias, out)


def _dot_types(x: torch.Tensor):
    """(tl.dot's operand dtype, its input_precision) for x: float32 "ieee" in the interpreter and for
    float32 x, else x's 16-bit type."""
    if is_interpreted(x.device) or x.dtype == torch.float32:
        return tl.float32, "ieee"
    return (tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16), "tf32"


def _reduce_splits(ws: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """out = dtype(ws.sum(0) (+ bias)): the second launch of a split-K call; ws float32 [splits, M, N]."""
    M, N = out.shape
    block = 1024
    _split_k_reduce_kernel[(cdiv(M * N, block),)](
        ws, bias if bias is not None else ws, out, M * N, N, ws.shape[0],
        HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)


def _dot_block_k(config: W4A16Config, K: int, group_size: int) -> int:
    """The GEMV tl.dot form's inputs a step: block_k clipped to the group (one group per step, so the scale
    applies to the dot's product); per-channel: block_k."""
    return config.block_k if group_size == K else min(config.block_k, group_size)


def _gemv_form(config: W4A16Config, M: int, K: int, group_size: int) -> Optional[int]:
    """The GEMV form that runs ``config`` on M rows, or None for the tiled kernel: GEMV_DOT up to
    GEMV_DOT_MAX_ROWS rows where its step keeps >= MIN_DOT_BLOCK_K inputs (else GEMV_FMA up to
    FMA_FALLBACK_ROWS rows), GEMV_FMA up to GEMV_MAX_ROWS rows."""
    if config.form == TILES:
        return None
    if config.form == GEMV_DOT and _dot_block_k(config, K, group_size) >= MIN_DOT_BLOCK_K:
        return GEMV_DOT if M <= GEMV_DOT_MAX_ROWS else None
    return GEMV_FMA if M <= (GEMV_MAX_ROWS if config.form == GEMV_FMA else FMA_FALLBACK_ROWS) else None


def _launch_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: Optional[torch.Tensor], config: W4A16Config, form: int,
                 out: torch.Tensor) -> None:
    """The GEMV form ``form`` (``_gemv_form``) of ``w4a16_matmul`` into ``out``."""
    M, K = x.shape
    N = out.shape[1]
    use_dot = form == GEMV_DOT
    block_k = _dot_block_k(config, K, group_size) if use_dot else config.block_k
    tiles = cdiv(N, config.block_n)
    plan = _plan_splits(cdiv(K, block_k), config, tiles, out)
    dot_dtype, dot_precision = _dot_types(x)
    x_pairs = (not use_dot and x.dtype == torch.bfloat16 and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0)
    _w4a16_gemv_kernel[(tiles, plan.num_splits)](
        x, qweight, scales, zeros, bias if bias is not None else scales, out, plan.ws, plan.counters,
        M, N, K, x.stride(0), plan.steps_per_split, plan.num_splits, MAGIC_EXP_BITS,
        GROUP_SIZE=0 if group_size == K else group_size, HAS_BIAS=bias is not None,
        SPLIT_OUT=plan.num_splits > 1, REDUCE_IN_KERNEL=plan.in_kernel,
        BLOCK_M=max(16, next_power_of_2(M)) if use_dot else next_power_of_2(M), BLOCK_N=config.block_n,
        BLOCK_K=block_k, USE_DOT=use_dot, X_PAIRS=x_pairs, MASK_X=K % block_k != 0,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision,
        num_warps=config.num_warps, num_stages=config.num_stages)
    _finish_splits(plan, bias, out)


# ----------------------------------------------------------------------------------------
# Layout helpers and the torch twin (the test oracle)
# ----------------------------------------------------------------------------------------
def pack_int4_along_k(q: torch.Tensor) -> torch.Tensor:
    """int32 [K // 8, N] qweight from int4 values q [K, N] (any integer dtype, values 0..15, K a
    multiple of 8): nibble i of row r is q[8r + i]."""
    check_tensor("q", q, ndim=2)
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise ValueError(f"q: expected an integer dtype, got {q.dtype}.")
    K, N = q.shape
    if K % PACK_FACTOR:
        raise ValueError(f"q: K = {K} rows must be a multiple of {PACK_FACTOR}.")
    q64 = q.to(torch.int64)
    if q64.numel() and (q64.min() < 0 or q64.max() > 15):
        raise ValueError("q: values must be in 0..15.")
    shifts = 4 * torch.arange(PACK_FACTOR, device=q.device, dtype=torch.int64)         # [8]
    nibbles = q64.reshape(K // PACK_FACTOR, PACK_FACTOR, N)                          # [K // 8, 8, N]
    packed = (nibbles << shifts[None, :, None]).sum(dim=1)                             # [K // 8, N]
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed)                   # as a signed int32
    return packed.to(torch.int32)


def unpack_int4_along_k(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K, N] values 0..15 from qweight int32 [K // 8, N] (the inverse of ``pack_int4_along_k``)."""
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,))
    rows, N = qweight.shape
    shifts = 4 * torch.arange(PACK_FACTOR, device=qweight.device, dtype=torch.int32)    # [8]
    return ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(rows * PACK_FACTOR, N)


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int) -> torch.Tensor:
    """float32 W [K, N] = (q - zeros[k // G]) * scales[k // G] (the module docstring's layout)."""
    q = unpack_int4_along_k(qweight).to(torch.float32)                                  # [K, N]
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=0)                   # [K, N]
    z = zeros.to(torch.float32).repeat_interleave(group_size, dim=0)                    # [K, N]
    return (q - z) * s


def w4a16_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Twin of ``w4a16_matmul``: ``dequantize_w4``, a float32 matmul (+ bias), one rounding to x's dtype."""
    out = x.float() @ dequantize_w4(qweight, scales, zeros, group_size)                  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
