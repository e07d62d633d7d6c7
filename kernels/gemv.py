"""Decode GEMV: out = a @ weight.T for 1..16 token rows, with an optional fused prologue.

At decode batch 1..16 every projection is a matrix-vector product bound by the weight read;
cuBLAS runs it as a GEMV or a split-K GEMM (two launches with the reduce), and the RMSNorm in
front of qkv / gate_up and the SiLU-and-mul in front of down are launches of their own. One
Triton kernel here reads each weight tile once for all M rows and builds its input rows on the
fly, so a projection plus its elementwise prologue is one launch:

- ``gemv(x, weight, bias)``: out = x @ weight.T (+ bias).
- ``silu_mul_gemv(gate_up, weight, bias)``: out = silu_and_mul(gate_up) @ weight.T (+ bias); the
  product rows are never written to memory: every program recomputes them per K chunk.
- ``add_rms_norm_gemv(x, residual, norm_weight, eps, weight, bias)``: out = rmsnorm(x + residual)
  @ weight.T (+ bias), and the residual sum as a new tensor. Every program computes the rows'
  mean square itself (a first pass over the K inputs of each row, from L2), then the main loop
  recomputes the normalized rows per K chunk; program 0 alone stores the residual sum.

Grid: one program per BLOCK_N output columns, each looping over all of K (no split-K, so no
reduce launch and no atomics). Two inner-product formulations, picked by ``GemvConfig.use_dot``:
``tl.dot`` on the [BLOCK_M >= 16, BLOCK_K] input tile and the [BLOCK_N, BLOCK_K] weight tile,
or an elementwise multiply of the [BLOCK_M, 1, BLOCK_K] and [1, BLOCK_N, BLOCK_K] tiles summed
over K (BLOCK_M = next power of two >= M). ``benchmarks/sweeps/gemv_sweep.py`` times both; on an H200
tl.dot wins at every M from 1 to 16, so it is the default. The fused prologues build only the
next_power_of_2(M) real rows and repeat them up to tl.dot's 16, and load their inputs one K
chunk ahead (register prefetch). Every program rebuilds all M input rows, so that work grows
with M: the fused launches pay off at M <= 2 and lose from M = 4-8 on (``gemv_config``'s note).

FP8 weights (W8A16): every wrapper also takes an e4m3 weight [N, K] with ``weight_scale`` (float32)
per output channel [N] or, with ``scale_block=(bn, bk)``, per block [cdiv(N, bn), cdiv(K, bk)] (HF's
block-wise ``fp8``, 128 x 128). The kernel reads the e4m3 tile (half the bytes of bf16) and converts
it to the activations' dtype in registers, exactly; per-channel scales multiply the float32
accumulator once at the end, block scales each BLOCK_K chunk's partial (block_k divides bk, so no
chunk straddles a block). The activations stay unquantized: a checkpoint's static input scale
(W8A8 static) is not applied, so the result is the dequantized weight's product, which is what the
CPU path computes, not the W8A8 GEMM's (``kernels.fp8_linear``), which rounds the activations to e4m3.

That widening (``GemvConfig.fp8_math`` = ``WIDEN``, the default) makes the loop issue-bound (see
``gemv_config``'s note). Two other maths spend fewer instructions per weight byte, each from the rows'
amax (one more pass over the input rows per program before the K loop; the add + RMSNorm prologue
gathers the bound rstd * max |norm_weight * s| in its statistics pass instead), always with tl.dot:

- ``E4M3_DOT``: the rows are rounded to e4m3 at the per-row scale amax / 448 (``fp8_linear``'s
  per-token scheme, inside the kernel: no quantization launch) and meet the e4m3 tile in an e4m3 x e4m3
  tl.dot (Hopper's FP8 MMA), float32 accumulation; the row scale multiplies the accumulator at the end.
  The weight is never widened; the rows carry e4m3's rounding, as with the W8A8 GEMM.
- ``F16_WIDEN``: the e4m3 tile is widened to float16 (one packed ``cvt`` per two values on sm_89+;
  bfloat16 takes Triton more instructions), the rows are multiplied by the power of two putting their
  amax in [2^14, 2^15) (no float16 overflow; bfloat16 rows keep all their bits) and rounded to float16,
  and a float16 tl.dot runs; the inverse power multiplies the accumulator. float32 rows take WIDEN.

Both take ``GemvConfig.swap_ab``: the dot as weight tile @ rows.T, the weight rows the MMA's M, which
Triton lowers for sm_90 to wgmma (e4m3 x e4m3 under E4M3_DOT; block_n >= 64 on 4 warps); the rows @
weight tile.T form of the other paths is mma.sync, where Triton runs an e4m3 dot as float16 MMAs.
Float weights ignore ``fp8_math`` (the engine's ``KernelPolicy.gemv`` override reaches every layer).

Numerics: float32 accumulation, bias added in float32, one rounding to x's dtype at the end;
the prologues round exactly as ``kernels.layer_ops`` does (see the kernel's docstring). The
torch twins are the ``*_ref`` functions at the end of this module, composed from
``kernels.reference.rms_norm_ref``, ``silu_and_mul_ref`` and a float32 ``F.linear`` (of the
dequantized weight, ``fp8_linear.dequantize_fp8_weight``, for FP8, on the rows rounded as the FP8
maths round them, ``round_rows_ref``); ``tests/kernels/test_kernel_gemv.py`` and
``test_kernel_fp8_gemv.py`` (the FP8 maths) compare the two.

Launch configs: ``gemv_config(M, N, K, override=...)`` (defaults, then the caller's field
overrides); every wrapper takes either an explicit ``config=`` or the ``override=`` it passes on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

import triton
import triton.language as tl

from kernels.fp8_linear import FP8_DTYPE, FP8_MAX, MIN_AMAX, _to_e4m3, dequantize_fp8_weight
from kernels.reference import rms_norm_ref, silu_and_mul_ref
from kernels.utils import FLOAT_DTYPES, cdiv, check_tensor, is_interpreted, next_power_of_2

MAX_ROWS = 16
"""Most token rows one call takes (the decode batches this kernel is for); more raise ValueError."""

PLAIN, SILU_MUL, ADD_RMSNORM = 0, 1, 2
"""Values of the kernel's PROLOGUE constexpr: how the input rows are built from the inputs."""

WIDEN, E4M3_DOT, F16_WIDEN = 0, 1, 2
"""Values of ``GemvConfig.fp8_math``: how an e4m3 weight tile meets the input rows (module docstring)."""
F16_TARGET_EXP = 14
"""``F16_WIDEN`` scales each input row by the power of two that puts its amax in [2^14, 2^15): below
float16's 65504, and small entries keep their bits (bfloat16's 8 significant bits fit float16's 11)."""
F16_MIN_EXP, F16_MAX_EXP = -100, 127
"""Range the row amax's binary exponent is clamped to, so the scale 2^(14 - e) and its inverse are
normal float32 values (an all-zero row has amax 0)."""

GemvOverride = tuple[tuple[str, int], ...]
"""(field, value) pairs of ``GemvConfig`` applied over the default config (the engine passes
``KernelPolicy.gemv``)."""


# ----------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------
@triton.jit
def _load_inputs(x_ptr, r_ptr, nw_ptr, rows, row_ok, k0, K, stride_x, stride_r,
                 BLOCK_K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Raw inputs of one [R, BLOCK_K] chunk (columns k0 + [0, BLOCK_K)), zero where masked:

        PLAIN / ADD_RMSNORM:  (x, residual (x without one), norm_weight [BLOCK_K] (zeros for PLAIN))
        SILU_MUL:             (gate, up, unused)

    NOTE: split from ``_build_input`` so the fused loops can issue the next chunk's loads before
    computing on this one (register prefetch). Without it every K step of every program waits
    on an L2 round trip for its input rows, which made the fused down_proj far slower at one row
    (``benchmarks/RESULTS.md``, "Launch configs and constants inside the kernels"); num_stages
    pipelines the weight loads only, whose tiles feed tl.dot directly.
    """
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    mask = row_ok[:, None] & k_ok[None, :]
    xp = x_ptr + rows[:, None] * stride_x + offs_k[None, :]
    p = tl.load(xp, mask=mask, other=0.0)
    if PROLOGUE == 1:
        q = tl.load(xp + K, mask=mask, other=0.0)
    elif HAS_RESIDUAL:
        q = tl.load(r_ptr + rows[:, None] * stride_r + offs_k[None, :], mask=mask, other=0.0)
    else:
        q = p
    if PROLOGUE == 2:
        nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0)
    else:
        nw = tl.zeros([BLOCK_K], dtype=p.dtype)
    return p, q, nw


@triton.jit
def _residual_sum(p, q, DTYPE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """s = DTYPE(x + residual) from ``_load_inputs``'s (x, residual) (x itself without residual)."""
    if HAS_RESIDUAL:
        return (p.to(tl.float32) + q.to(tl.float32)).to(DTYPE)
    return p


@triton.jit
def _build_input(p, q, nw, rstd, DTYPE: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """[R, BLOCK_K] tile of the GEMV input a in DTYPE from ``_load_inputs``'s raw chunk;
    ``rstd`` ([R, 1] float32) is read by the add_rmsnorm prologue only."""
    if PROLOGUE == 1:      # SILU_MUL
        g = p.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
        a = (act * q.to(tl.float32)).to(DTYPE)
    elif PROLOGUE == 2:    # ADD_RMSNORM
        s = _residual_sum(p, q, DTYPE, HAS_RESIDUAL)
        n = (s.to(tl.float32) * rstd).to(DTYPE).to(tl.float32)
        a = (nw.to(tl.float32)[None, :] * n).to(DTYPE)
    else:                  # PLAIN
        a = p
    return a


_E4M3X4_TO_F32 = tl.constexpr("""{
.reg .b16 lo, hi, h0, h1, h2, h3;
.reg .b32 plo, phi;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 plo, lo;
cvt.rn.f16x2.e4m3x2 phi, hi;
mov.b32 {h0, h1}, plo;
mov.b32 {h2, h3}, phi;
cvt.f32.f16 $0, h0;
cvt.f32.f16 $1, h1;
cvt.f32.f16 $2, h2;
cvt.f32.f16 $3, h3;
}""")
"""PTX (sm_89+): four e4m3 bytes of one register -> four float32, through two f16x2 conversions."""


@triton.jit
def _e4m3_to_f32(w, UPCAST: tl.constexpr):
    """e4m3 tile -> float32, exactly: four bytes per ``cvt.rn.f16x2.e4m3x2`` pair on CUDA (Triton's own
    conversion moves each byte into place apart); the interpreter (UPCAST) converts as is."""
    if UPCAST:
        return w.to(tl.float32)
    return tl.inline_asm_elementwise(_E4M3X4_TO_F32, "=r,=r,=r,=r,r", [w.to(tl.uint8, bitcast=True)],
                                     dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def _accumulate(acc, a, w, BLOCK_M: tl.constexpr, BLOCK_MA: tl.constexpr, BLOCK_K: tl.constexpr,
                USE_DOT: tl.constexpr, REDUCE_ONCE: tl.constexpr, UPCAST: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += a [BLOCK_MA, BLOCK_K] @ w [BLOCK_N, BLOCK_K].T (float32); with
    REDUCE_ONCE (elementwise form) acc is [BLOCK_M, BLOCK_N, BLOCK_K] and gets the products
    unreduced (the kernel sums over K once, after the loop).

    With tl.dot and BLOCK_MA < BLOCK_M the rows of a are repeated to BLOCK_M (row r of acc gets
    row r % BLOCK_MA: the first BLOCK_MA rows are the real ones). With tl.dot w is in a's dtype
    (``_accumulate_tile`` converts an FP8 tile); the elementwise forms take any float w."""
    if USE_DOT:
        if BLOCK_MA < BLOCK_M:
            a = tl.reshape(tl.broadcast_to(a[None, :, :], [BLOCK_M // BLOCK_MA, BLOCK_MA, BLOCK_K]),
                           [BLOCK_M, BLOCK_K])
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
    elif REDUCE_ONCE:
        acc += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    else:
        acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _accumulate_tile(acc, a, w, a_mul, ws_rows, k0, n_ok, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_MA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     W_FP8: tl.constexpr, SCALE_BK: tl.constexpr, USE_DOT: tl.constexpr,
                     REDUCE_ONCE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     FP8_MATH: tl.constexpr, SWAP_AB: tl.constexpr):
    """``_accumulate`` of one K chunk whose weight tile w [BLOCK_N, BLOCK_K] is in DTYPE or, with
    W_FP8, e4m3 (converted to DTYPE for tl.dot, to float32 by the elementwise forms; exact). With
    block scales (SCALE_BK > 0; the chunk lies in one SCALE_BK-wide block), ws_rows [BLOCK_N]
    pointing at the rows' scale rows: the chunk's partial is multiplied by each row's scale of that
    block, or with REDUCE_ONCE the float32 weight tile is (float(w) * s: the dequantized weight).
    FP8_MATH > 0 (W_FP8): ``_accumulate_fp8`` with the rows' multipliers a_mul [BLOCK_MA] instead."""
    if FP8_MATH > 0:
        acc = _accumulate_fp8(acc, a, w, a_mul, ws_rows, k0, n_ok, BLOCK_M, BLOCK_MA, BLOCK_K, SCALE_BK,
                              FP8_MATH, UPCAST, SWAP_AB)
    else:
        acc = _accumulate_widened(acc, a, w, ws_rows, k0, n_ok, DTYPE, BLOCK_M, BLOCK_MA, BLOCK_N, BLOCK_K,
                                  W_FP8, SCALE_BK, USE_DOT, REDUCE_ONCE, UPCAST, DOT_PRECISION)
    return acc


@triton.jit
def _accumulate_widened(acc, a, w, ws_rows, k0, n_ok, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_MA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        W_FP8: tl.constexpr, SCALE_BK: tl.constexpr, USE_DOT: tl.constexpr,
                        REDUCE_ONCE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``_accumulate_tile`` for FP8_MATH == WIDEN (and float weights)."""
    if W_FP8:
        if USE_DOT:
            w = w.to(DTYPE)
        else:
            w = _e4m3_to_f32(w, UPCAST)
    if SCALE_BK > 0:
        s = tl.load(ws_rows + k0 // SCALE_BK, mask=n_ok, other=0.0)                      # [BLOCK_N]
        if REDUCE_ONCE:
            acc = _accumulate(acc, a, w.to(tl.float32) * s[:, None], BLOCK_M, BLOCK_MA, BLOCK_K, USE_DOT,
                              REDUCE_ONCE, UPCAST, DOT_PRECISION)
        else:
            part = _accumulate(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), a, w, BLOCK_M, BLOCK_MA, BLOCK_K,
                               USE_DOT, False, UPCAST, DOT_PRECISION)
            acc += part * s[None, :]
    else:
        acc = _accumulate(acc, a, w, BLOCK_M, BLOCK_MA, BLOCK_K, USE_DOT, REDUCE_ONCE, UPCAST,
                          DOT_PRECISION)
    return acc


_FP8_MAX_C = tl.constexpr(FP8_MAX)
_MIN_AMAX_C = tl.constexpr(MIN_AMAX)
_F16_TARGET_EXP_C = tl.constexpr(F16_TARGET_EXP)
_F16_MIN_EXP_C = tl.constexpr(F16_MIN_EXP)
_F16_MAX_EXP_C = tl.constexpr(F16_MAX_EXP)


@triton.jit
def _row_multipliers(amax, FP8_MATH: tl.constexpr):
    """(input multiplier, accumulator multiplier), each [R] float32, from the rows' amax [R] (float32):

        E4M3_DOT:   (div(1, xs), xs), xs = div(max(amax, MIN_AMAX), 448)   (``fp8_linear``'s per-token scale)
        F16_WIDEN:  (2^(14 - e), 2^(e - 14)), e = amax's binary exponent clamped to [-100, 127]
    """
    if FP8_MATH == 1:
        xs = tl.math.div_rn(tl.maximum(amax, _MIN_AMAX_C), _FP8_MAX_C)
        return tl.math.div_rn(1.0, xs), xs
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.minimum(tl.maximum(e, _F16_MIN_EXP_C), _F16_MAX_EXP_C)
    up = ((-e + (127 + _F16_TARGET_EXP_C)) << 23).to(tl.float32, bitcast=True)
    down = ((e + (127 - _F16_TARGET_EXP_C)) << 23).to(tl.float32, bitcast=True)
    return up, down


@triton.jit
def _repeat_rows(v, BLOCK_M: tl.constexpr, BLOCK_MA: tl.constexpr):
    """[BLOCK_MA] -> [BLOCK_M]: entry r is v[r % BLOCK_MA] (the row copies tl.dot's 16 rows carry)."""
    if BLOCK_MA < BLOCK_M:
        v = tl.reshape(tl.broadcast_to(v[None, :], [BLOCK_M // BLOCK_MA, BLOCK_MA]), [BLOCK_M])
    return v


@triton.jit
def _accumulate_fp8(acc, a, w, a_mul, ws_rows, k0, n_ok, BLOCK_M: tl.constexpr, BLOCK_MA: tl.constexpr,
                    BLOCK_K: tl.constexpr, SCALE_BK: tl.constexpr, FP8_MATH: tl.constexpr,
                    SOFT_ROUND: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += q @ w.T (float32) for one K chunk of an e4m3 weight tile w [BLOCK_N, BLOCK_K]
    without widening it to the activations' dtype; with SWAP_AB acc is [BLOCK_N, BLOCK_M] and gets w @ q.T
    (the weight rows as the MMA's M: with BLOCK_N >= 64 on 4 warps Triton lowers it to Hopper's wgmma,
    e4m3 x e4m3 for E4M3_DOT; the unswapped e4m3 dot with 16 rows runs as float16 mma.sync):

        E4M3_DOT:   q = e4m3(clamp(a * a_mul, -448, 448)), the e4m3 x e4m3 tl.dot (Hopper's FP8 MMA)
        F16_WIDEN:  q = float16(a * a_mul), w widened to float16 (one packed cvt per two values), float16 tl.dot

    a [BLOCK_MA, BLOCK_K] (any float), a_mul [BLOCK_MA] float32 (``_row_multipliers``); the rows of q are
    repeated to BLOCK_M as in ``_accumulate``. With block scales (SCALE_BK > 0) the chunk's partial is
    multiplied by each weight row's scale of its block (ws_rows as in ``_accumulate_tile``)."""
    v = a.to(tl.float32) * a_mul[:, None]
    if FP8_MATH == 1:
        q = _to_e4m3(v, SOFT_ROUND)
        wq = w
    else:
        q = v.to(tl.float16)
        wq = w.to(tl.float16)
    if BLOCK_MA < BLOCK_M:
        q = tl.reshape(tl.broadcast_to(q[None, :, :], [BLOCK_M // BLOCK_MA, BLOCK_MA, BLOCK_K]), [BLOCK_M, BLOCK_K])
    if SWAP_AB:
        if SCALE_BK > 0:
            s = tl.load(ws_rows + k0 // SCALE_BK, mask=n_ok, other=0.0)                  # [BLOCK_N]
            acc += tl.dot(wq, tl.trans(q), out_dtype=tl.float32) * s[:, None]
        else:
            acc = tl.dot(wq, tl.trans(q), acc, out_dtype=tl.float32)
    elif SCALE_BK > 0:
        s = tl.load(ws_rows + k0 // SCALE_BK, mask=n_ok, other=0.0)                      # [BLOCK_N]
        acc += tl.dot(q, tl.trans(wq), out_dtype=tl.float32) * s[None, :]
    else:
        acc = tl.dot(q, tl.trans(wq), acc, out_dtype=tl.float32)
    return acc


@triton.jit
def _rows_amax(x_ptr, r_ptr, nw_ptr, rows, row_ok, K, stride_x, stride_r, BLOCK_MA: tl.constexpr,
               BLOCK_KS: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, DTYPE: tl.constexpr):
    """max_k |a[r, k]| [BLOCK_MA] (float32) of the input rows the PLAIN / SILU_MUL prologue builds: one pass over
    K in BLOCK_KS chunks, the next chunk's loads issued first."""
    amax = tl.zeros([BLOCK_MA], dtype=tl.float32)
    rstd = tl.zeros([BLOCK_MA, 1], dtype=tl.float32)
    p, q, nw = _load_inputs(x_ptr, r_ptr, nw_ptr, rows, row_ok, 0, K, stride_x, stride_r, BLOCK_KS, PROLOGUE,
                            HAS_RESIDUAL)
    for k0 in range(0, K, BLOCK_KS):
        p_next, q_next, nw_next = _load_inputs(x_ptr, r_ptr, nw_ptr, rows, row_ok, k0 + BLOCK_KS, K, stride_x,
                                               stride_r, BLOCK_KS, PROLOGUE, HAS_RESIDUAL)
        a = _build_input(p, q, nw, rstd, DTYPE, PROLOGUE, HAS_RESIDUAL)
        amax = tl.maximum(amax, tl.max(tl.abs(a.to(tl.float32)), axis=1))
        p, q, nw = p_next, q_next, nw_next
    return amax


@triton.jit
def _gemv_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, res_out_ptr,
                 M, N, K, eps, stride_x, stride_r, num_scale_kblocks,
                 PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                 W_FP8: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_MA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_KS: tl.constexpr, USE_DOT: tl.constexpr, REDUCE_ONCE: tl.constexpr, UPCAST: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, FP8_MATH: tl.constexpr, SWAP_AB: tl.constexpr):
    """Semantics (dtype = out's dtype = x's dtype; float32 math unless rounded by dtype(.)):

        for t in range(M):
            if PROLOGUE == PLAIN:        a = x[t]                                       # [K]
            if PROLOGUE == SILU_MUL:     g, u = x[t, :K], x[t, K:2K]
                                         a = dtype(dtype(silu(g)) * u)
            if PROLOGUE == ADD_RMSNORM:  s = dtype(x[t] + residual[t]) if HAS_RESIDUAL else x[t]
                                         a = dtype(nw * dtype(s * rsqrt(mean(s^2) + eps)))
                                         if HAS_RESIDUAL: res_out[t] = s      (program 0 only)
            out[t] = dtype(a @ W.T + (b if HAS_BIAS else 0))                            # [N]

    W = w (x's dtype) unless W_FP8; with W_FP8, w is e4m3 and W[n, k] = float(w[n, k]) * s, the scale
    s = ws[n] per channel (SCALE_BK == 0: applied once to the float32 accumulator) or
    ws[n // SCALE_BN, k // SCALE_BK] per block (ws [cdiv(N, SCALE_BN), num_scale_kblocks]: each
    BLOCK_K chunk lies in one block, BLOCK_K divides SCALE_BK, and its partial product is scaled).
    The e4m3 tile is converted to dtype in registers (exact for float16 / bfloat16 / float32) with
    FP8_MATH == WIDEN. The other FP8_MATH values (W_FP8 only, always tl.dot) round the input rows
    instead, per row t from amax_t = max_k |a[t, k]| (ADD_RMSNORM: the bound rstd_t * max_k |nw[k] * s[t, k]|,
    gathered in the statistics pass; its rounding overshoot is clamped):

        E4M3_DOT:   xs_t = amax_t / 448;  out[t] = dtype(xs_t * (e4m3(clamp(a / xs_t, +-448)) @ W.T) + b)
        F16_WIDEN:  u_t = 2^(14 - exponent(amax_t));  out[t] = dtype((float16(a * u_t) @ W.T) / u_t + b)

    (W's scales as above, applied to the float32 accumulator; the row factor multiplies it at the end).
    SWAP_AB (FP8_MATH > 0 only) accumulates the transposed product, weight rows first (``_accumulate_fp8``).

    Program p covers columns [p * BLOCK_N, (p + 1) * BLOCK_N) of all M rows over all of K.
    w: [N, K] contiguous; x / residual rows at strides stride_x / stride_r (last dim stride 1);
    out: [M, N] and res_out: [M, K] contiguous. Every program computes mean(s^2) itself (a first
    pass over K in BLOCK_KS chunks), then recomputes a per BLOCK_K chunk next to the weight tile.
    res_out must not alias x or residual (other programs still read them while program 0 stores it).

    Tiles: the input rows are built BLOCK_MA >= M at a time (the prologue's work scales with it);
    tl.dot takes BLOCK_M = max(16, BLOCK_MA) rows, the BLOCK_MA rows repeated (the copies past
    row M are computed and never stored). The elementwise form has BLOCK_M == BLOCK_MA; with
    REDUCE_ONCE it keeps [BLOCK_M, BLOCK_N, BLOCK_K] float32 partial sums over the K loop and
    reduces them over K once at the end (no cross-thread reduction per step).
    """
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    offs_ma = tl.arange(0, BLOCK_MA)
    ma_ok = offs_ma < M
    rows_a = offs_ma.to(tl.int64)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K                                   # [BLOCK_N, 1]
    ws_rows = ws_ptr + (offs_n // SCALE_BN) * num_scale_kblocks                          # [BLOCK_N]

    rstd = tl.zeros([BLOCK_MA, 1], dtype=tl.float32)
    if PROLOGUE == 2:
        # Wide chunks (BLOCK_KS >= BLOCK_K, ~4096 elements), next chunk's loads issued first: this
        # pass is a few L2 round trips every program pays before its first weight tile arrives.
        ss = tl.zeros([BLOCK_MA], dtype=tl.float32)
        nws_amax = tl.zeros([BLOCK_MA], dtype=tl.float32)
        # FP8_MATH also reads the norm weight here, for the rows' amax bound.
        p, q, nw = _load_inputs(x_ptr, r_ptr, nw_ptr, rows_a, ma_ok, 0, K, stride_x, stride_r,
                                BLOCK_KS, 2 if FP8_MATH > 0 else 0, HAS_RESIDUAL)
        for k0 in range(0, K, BLOCK_KS):
            p_next, q_next, nw_next = _load_inputs(x_ptr, r_ptr, nw_ptr, rows_a, ma_ok, k0 + BLOCK_KS, K, stride_x,
                                                   stride_r, BLOCK_KS, 2 if FP8_MATH > 0 else 0, HAS_RESIDUAL)
            s = _residual_sum(p, q, DTYPE, HAS_RESIDUAL)                                 # [BMA, BKS]
            if FP8_MATH > 0:
                nws_amax = tl.maximum(nws_amax, tl.max(tl.abs(nw.to(tl.float32)[None, :] * s.to(tl.float32)),
                                                       axis=1))
            if HAS_RESIDUAL:
                if pid == 0:
                    offs_k = k0 + tl.arange(0, BLOCK_KS)
                    tl.store(res_out_ptr + rows_a[:, None] * K + offs_k[None, :], s,
                             mask=ma_ok[:, None] & (offs_k < K)[None, :])
            sf = s.to(tl.float32)
            ss += tl.sum(sf * sf, axis=1)
            p, q, nw = p_next, q_next, nw_next
        rstd_rows = tl.rsqrt(ss / K + eps)                                              # [BLOCK_MA]
        rstd = rstd_rows[:, None]                                                       # [BLOCK_MA, 1]

    a_mul = tl.zeros([BLOCK_MA], dtype=tl.float32)      # FP8_MATH: input rows' multiplier
    acc_mul = tl.zeros([BLOCK_MA], dtype=tl.float32)    # FP8_MATH: accumulator rows' multiplier
    if FP8_MATH > 0:
        if PROLOGUE == 2:
            amax = nws_amax * rstd_rows                                                 # [BLOCK_MA]
        else:
            amax = _rows_amax(x_ptr, r_ptr, nw_ptr, rows_a, ma_ok, K, stride_x, stride_r, BLOCK_MA, BLOCK_KS,
                              PROLOGUE, HAS_RESIDUAL, DTYPE)
        a_mul, acc_mul = _row_multipliers(amax, FP8_MATH)

    if REDUCE_ONCE:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    elif SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)                            # transposed
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PROLOGUE == 0:
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)   # [BN, BK]
            a = tl.load(x_ptr + rows_a[:, None] * stride_x + offs_k[None, :], mask=ma_ok[:, None] & k_ok[None, :],
                        other=0.0)                                                     # [BMA, BK]
            acc = _accumulate_tile(acc, a, w, a_mul, ws_rows, k0, n_ok, DTYPE, BLOCK_M, BLOCK_MA, BLOCK_N, BLOCK_K,
                                   W_FP8, SCALE_BK, USE_DOT, REDUCE_ONCE, UPCAST, DOT_PRECISION, FP8_MATH,
                                   SWAP_AB)
    else:
        p, q, nw = _load_inputs(x_ptr, r_ptr, nw_ptr, rows_a, ma_ok, 0, K, stride_x, stride_r,
                                BLOCK_K, PROLOGUE, HAS_RESIDUAL)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0)
            p_next, q_next, nw_next = _load_inputs(x_ptr, r_ptr, nw_ptr, rows_a, ma_ok, k0 + BLOCK_K, K,
                                                   stride_x, stride_r, BLOCK_K, PROLOGUE, HAS_RESIDUAL)
            a = _build_input(p, q, nw, rstd, DTYPE, PROLOGUE, HAS_RESIDUAL)               # [BMA, BK]
            acc = _accumulate_tile(acc, a, w, a_mul, ws_rows, k0, n_ok, DTYPE, BLOCK_M, BLOCK_MA, BLOCK_N, BLOCK_K,
                                   W_FP8, SCALE_BK, USE_DOT, REDUCE_ONCE, UPCAST, DOT_PRECISION, FP8_MATH,
                                   SWAP_AB)
            p, q, nw = p_next, q_next, nw_next
    if REDUCE_ONCE:
        acc = tl.sum(acc, axis=2)                                                       # [BLOCK_M, BLOCK_N]
    if SWAP_AB:
        acc = tl.trans(acc)                                                             # [BLOCK_M, BLOCK_N]
    if W_FP8:
        if SCALE_BK == 0:
            acc *= tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        if FP8_MATH > 0:
            acc *= _repeat_rows(acc_mul, BLOCK_M, BLOCK_MA)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    offs_m = tl.arange(0, BLOCK_M)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(DTYPE),
             mask=(offs_m < M)[:, None] & n_ok[None, :])


# ----------------------------------------------------------------------------------------
# Launch configs
# ----------------------------------------------------------------------------------------
def _check_pow2(name: str, value: object, min_value: int, max_value: int) -> None:
    if (isinstance(value, bool) or not isinstance(value, int) or not min_value <= value <= max_value
            or value & (value - 1)):
        raise ValueError(f"GemvConfig.{name}: {value!r} must be a power of two in [{min_value}, {max_value}].")


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of the decode GEMV."""

    block_n: int = 32
    """Output columns (weight rows) per program; the grid is cdiv(N, block_n). Power of two in
    [1, 1024], >= 16 with use_dot."""
    block_k: int = 256
    """Input elements per inner step (weight tile [block_n, block_k]). Power of two in [16, 4096]."""
    num_warps: int = 4
    """Warps per program (power of two in [1, 16])."""
    num_stages: int = 3
    """Software-pipelining depth of the K loop (>= 1)."""
    use_dot: int = 0
    """1: tl.dot on a [BLOCK_M >= 16, block_k] input tile (rows past M are zero padding);
    0: elementwise multiply + sum over K with BLOCK_M = next power of two >= M."""
    reduce_once: int = 0
    """Elementwise form only (ignored with use_dot): 1 keeps [BLOCK_M, block_n, block_k] float32
    partial sums over the K loop and reduces them once at the end (registers grow with all three);
    0 reduces each K step's products."""
    fp8_math: int = 0
    """How an e4m3 weight tile meets the input rows (ignored for float weights): ``WIDEN`` (0) converts
    it to the activations' dtype (the forms above); ``E4M3_DOT`` (1) rounds the rows to e4m3 with a
    per-row scale and runs the e4m3 x e4m3 tl.dot; ``F16_WIDEN`` (2) widens it to float16 and runs a
    float16 tl.dot on the rows pre-scaled by a power of two (float32 activations: WIDEN instead). 1 and
    2 always take tl.dot (use_dot and reduce_once are ignored)."""
    swap_ab: int = 0
    """fp8_math 1 and 2 only: 1 runs the dot as weight tile @ rows.T (the weight rows as the MMA's M),
    which with block_n >= 64 on 4 warps compiles for sm_90 to wgmma (e4m3 x e4m3 under E4M3_DOT); 0 as
    rows @ weight tile.T, which compiles to mma.sync (the e4m3 dot as float16 MMAs)."""

    def __post_init__(self) -> None:
        if self.use_dot not in (0, 1) or isinstance(self.use_dot, float):
            raise ValueError(f"GemvConfig.use_dot: {self.use_dot!r} must be 0 or 1.")
        if self.reduce_once not in (0, 1) or isinstance(self.reduce_once, float):
            raise ValueError(f"GemvConfig.reduce_once: {self.reduce_once!r} must be 0 or 1.")
        if self.fp8_math not in (WIDEN, E4M3_DOT, F16_WIDEN) or isinstance(self.fp8_math, (bool, float)):
            raise ValueError(f"GemvConfig.fp8_math: {self.fp8_math!r} must be 0 (widen), 1 (e4m3 dot) "
                             f"or 2 (f16 widen).")
        if self.swap_ab not in (0, 1) or isinstance(self.swap_ab, float):
            raise ValueError(f"GemvConfig.swap_ab: {self.swap_ab!r} must be 0 or 1.")
        _check_pow2("block_n", self.block_n, 16 if self.use_dot or self.fp8_math else 1, 1024)
        _check_pow2("block_k", self.block_k, 16, 4096)
        _check_pow2("num_warps", self.num_warps, 1, 16)
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"GemvConfig.num_stages: {self.num_stages!r} must be an int >= 1.")

    def block_m(self, num_rows: int) -> int:
        """BLOCK_M for ``num_rows`` token rows: next power of two >= num_rows (>= 16 with use_dot)."""
        return max(16 if self.use_dot else 1, next_power_of_2(num_rows))

    def for_operands(self, weight_fp8: bool, dtype: torch.dtype) -> "GemvConfig":
        """The config one launch runs: fp8_math WIDEN for float weights; on an e4m3 weight, use_dot on
        under E4M3_DOT / F16_WIDEN; run as WIDEN (still tl.dot): F16_WIDEN of float32 rows, and E4M3_DOT
        with block_k < 32 (the FP8 MMA's K step; scale blocks of 16 inputs cut block_k to 16)."""
        if not weight_fp8:
            return dataclasses.replace(self, fp8_math=WIDEN) if self.fp8_math != WIDEN else self
        if self.fp8_math == WIDEN:
            return self
        math = self.fp8_math
        if (math == F16_WIDEN and dtype == torch.float32) or (math == E4M3_DOT and self.block_k < 32):
            math = WIDEN
        return dataclasses.replace(self, fp8_math=math, use_dot=1)


def _tiles(config: GemvConfig, M: int, K: int, prologue: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_MA, BLOCK_KS) of one launch.

    BLOCK_MA: rows the prologue builds; the plain tl.dot form loads all BLOCK_M rows masked
    (no extra work), the fused prologues and the FP8 maths (whose rounding of the rows is work)
    build next_power_of_2(M) and repeat them for tl.dot.
    BLOCK_KS: chunk of the add_rmsnorm statistics pass, ~4096 elements so that pass is one or a
    few L2 round trips.
    """
    block_m = config.block_m(M)
    block_ma = block_m if prologue == PLAIN and config.fp8_math == WIDEN else next_power_of_2(M)
    block_ks = max(config.block_k, min(next_power_of_2(K), 4096 // block_ma))
    return block_m, block_ma, block_ks


def gemv_config(M: int, N: int, K: int, device: Optional[torch.device] = None, prologue: int = PLAIN,
                override: GemvOverride = (), scale_block_k: Optional[int] = None, weight_fp8: bool = False
                ) -> GemvConfig:
    """The default config for an [M, K] x [N, K]^T decode GEMV, with ``override`` applied last.

    Args:
        M, N, K: token rows, output columns (weight rows), inputs per row.
        device: where it runs; a CPU device means the interpreter (small, quick tiles). None: CUDA.
        prologue: PLAIN, SILU_MUL or ADD_RMSNORM.
        override: ``GemvConfig`` (field, value) pairs; ValueError for an unknown field or a value
            the config rejects.
        scale_block_k: inputs per scale block of a block-scaled FP8 weight (None: none); block_k is
            then cut to the largest power of two dividing it (after the override), so no chunk
            straddles a block.
        weight_fp8: an e4m3 weight; with the override's fp8_math E4M3_DOT / F16_WIDEN the defaults are
            those maths' tiles (below).

    NOTE: defaults chosen with ``benchmarks/sweeps/gemv_sweep.py`` on an H200 (Llama-3-8B shapes,
    bf16, M 1..16, weights from HBM, CUDA graphs): tl.dot beats the elementwise form at every M,
    and the plain GEMVs are about level with cuBLAS. Plain: block_n 32 / block_k 512 for N <=
    16384 (qkv, o, down), block_n 64 / block_k 256 above (gate_up, lm_head); 4 warps, 3 stages;
    each close to the best tile of its case. Fused prologues (every program rebuilds its input
    rows, so wider block_n pays above 16384): block_n 32 / block_k 512 up to 16384, block_n 128 /
    block_k 128 above. Against norm / SiLU kernel + cuBLAS the fused launches are on a par or
    ahead at M <= 2 and lose from M = 4-8 on, because the rebuild's cost grows with M: hence
    ``KernelPolicy.decode_gemv_max_tokens`` (``benchmarks/RESULTS.md``, "What sets each ``KernelPolicy``
    default" and "Launch configs and constants inside the kernels").

    NOTE (FP8 weights): widening e4m3 costs ALU work per weight byte that bf16 weights do not pay,
    enough to make the loop issue-bound rather than bytes-bound. Compiled for sm_90, the K loop
    issues per weight byte about 0.15 warp instructions with tl.dot (block_n 32 / block_k 512;
    bf16: 0.03) and about 0.12 in the elementwise reduce-once form at one row (0.16 at two), where
    ``_e4m3_to_f32`` converts four bytes per two ``cvt`` instructions; the H200 issues about 0.2 per
    byte of HBM bandwidth. ``benchmarks/sweeps/fp8_sweep.py`` on the H200 at one row: the bf16 tiles
    (tl.dot) are the best or within 5% of it on o, down and qkv (11.5 / 31.2 / 16.2 us), the
    reduce-once form 8-60% slower but on qkv (15.6); so FP8 weights take the bf16 tiles.
    On CUDA an e4m3 weight takes ``fp8_math`` E4M3_DOT (module docstring) unless the override names
    another: ``fp8_sweep.py --maths`` on the H200 (Llama-3-8B shapes, per-channel scales, us at one row,
    default tiles): E4M3_DOT o 10.9 / down 27.5 / qkv 11.0 / gate_up 31.6 against WIDEN 11.8 / 30.3 /
    16.1 / 45.6 and the W8A8 GEMM with its quantization 12.8 / 37.3 / 15.0 / 33.8 (floors 3.5 / 12.2 /
    5.3 / 24.5); with the prologues fused, down (SiLU-and-mul) 30.5 vs 38.0, qkv (add + RMSNorm) 13.3,
    gate_up 32.6. Its tiles are swapped (``swap_ab``: wgmma on sm_90), block_n 64 / block_k 512 up to
    N = 16384 and 128 / 256 above (each within 2% of its grid's best); on 128 x 128 scale blocks 64 / 128
    with 6 stages (the grid's best: o 13.3, qkv 13.6, gate_up 32.7, down 43.3-43.9, where the unblocked
    tiles took 17.2 / 18.0 / 34.2 / 87.6). F16_WIDEN (only by override) takes unswapped 32 / 512 up to
    N = 16384 and 64 / 256 above, its grid's best (down 25.6, o 10.1; qkv 13.1, gate_up 32.9).
    """
    interpreted = device is not None and is_interpreted(device)
    fp8_math = dict(override).get("fp8_math", WIDEN if interpreted else E4M3_DOT) if weight_fp8 else WIDEN
    if interpreted:
        cfg = GemvConfig(block_n=min(64, max(16, next_power_of_2(N))), block_k=min(128, max(16, next_power_of_2(K))),
                         num_warps=4, num_stages=1, use_dot=0)
    elif fp8_math == E4M3_DOT and scale_block_k is not None:
        cfg = GemvConfig(64, 128, 4, 6, 1, fp8_math=E4M3_DOT, swap_ab=1)
    elif fp8_math == E4M3_DOT:
        cfg = GemvConfig(*((64, 512) if N <= 16384 else (128, 256)), 4, 3, 1, fp8_math=E4M3_DOT, swap_ab=1)
    elif fp8_math == F16_WIDEN:
        cfg = GemvConfig(*((32, 512) if N <= 16384 else (64, 256)), 4, 3, 1, fp8_math=F16_WIDEN)
    elif N <= 16384:
        cfg = GemvConfig(32, 512, 4, 3, 1)
    else:
        cfg = GemvConfig(64, 256, 4, 3, 1) if prologue == PLAIN else GemvConfig(128, 128, 4, 3, 1)
    if override:
        fields = dict(override)
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(GemvConfig)})
        if unknown:
            raise ValueError(f"GEMV config override: unknown field(s) {unknown}; use block_n, block_k, "
                             f"num_warps, num_stages, use_dot, reduce_once, fp8_math, swap_ab.")
        cfg = dataclasses.replace(cfg, **fields)
    if scale_block_k is not None and scale_block_k % cfg.block_k:
        cfg = dataclasses.replace(cfg, block_k=min(cfg.block_k, scale_block_k & -scale_block_k))
    return cfg


def fp8_scale_block_supported(scale_block: Optional[tuple[int, int]]) -> bool:
    """Whether the GEMV takes an FP8 weight with these (rows, inputs) scale blocks (None: per channel):
    the inputs per block must be a multiple of 16 (the smallest K chunk)."""
    return scale_block is None or scale_block[1] % 16 == 0


# ----------------------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------------------
def _check_rows(name: str, x: torch.Tensor) -> int:
    check_tensor(name, x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{name}: {x.shape[0]} rows; the decode GEMV takes at most {MAX_ROWS} "
                         f"(use torch.matmul for larger batches).")
    return x.shape[0]


def _check_weights(x: torch.Tensor, K: int, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   config: Optional[GemvConfig], weight_scale: Optional[torch.Tensor],
                   scale_block: Optional[tuple[int, int]]) -> int:
    """Check weight [N, K] (contiguous, x's dtype or e4m3 with its scales, x's device), bias [N] and
    config; returns N."""
    fp8 = isinstance(weight, torch.Tensor) and weight.dtype == FP8_DTYPE
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype, FP8_DTYPE) if fp8 else (x.dtype,), device=x.device,
                 contiguous=True)
    check_tensor("weight", weight, shape=(None, K))
    N = weight.shape[0]
    if N < 1 or K < 1:
        raise ValueError(f"weight: shape {tuple(weight.shape)} must have N >= 1 rows and K >= 1 columns.")
    if not fp8 and (weight_scale is not None or scale_block is not None):
        raise ValueError(f"weight_scale / scale_block: given for a {weight.dtype} weight; they go with a "
                         f"float8_e4m3fn weight only.")
    if fp8:
        if scale_block is None:
            check_tensor("weight_scale", weight_scale, dtypes=(torch.float32,), shape=(N,), device=x.device,
                         contiguous=True)
        else:
            if (not isinstance(scale_block, tuple) or len(scale_block) != 2
                    or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in scale_block)):
                raise ValueError(f"scale_block: expected (rows, inputs) positive ints, got {scale_block!r}.")
            if not fp8_scale_block_supported(scale_block):
                raise ValueError(f"scale_block: {scale_block} has {scale_block[1]} inputs per block; the GEMV "
                                 f"needs a multiple of 16 (use kernels.fp8_linear.fp8_linear).")
            check_tensor("weight_scale", weight_scale, dtypes=(torch.float32,),
                         shape=(cdiv(N, scale_block[0]), cdiv(K, scale_block[1])), device=x.device, contiguous=True)
    if bias is not None:
        check_tensor("bias", bias, dtypes=(x.dtype,), shape=(N,), device=x.device, contiguous=True)
    if config is not None and not isinstance(config, GemvConfig):
        raise ValueError(f"config: expected a GemvConfig, got {type(config).__name__}.")
    if config is not None and scale_block is not None and scale_block[1] % config.block_k:
        raise ValueError(f"config.block_k: {config.block_k} must divide the scale block's {scale_block[1]} inputs.")
    return N


def _launch(prologue: int, x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor],
            eps: float, weight: torch.Tensor, bias: Optional[torch.Tensor], res_out: Optional[torch.Tensor],
            config: Optional[GemvConfig], override: GemvOverride, weight_scale: Optional[torch.Tensor] = None,
            scale_block: Optional[tuple[int, int]] = None) -> torch.Tensor:
    M, (N, K) = x.shape[0], weight.shape
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)                            # [M, N]
    if M == 0:
        return out
    scale_bn, scale_bk = scale_block if scale_block is not None else (1, 0)
    if config is None:
        config = gemv_config(M, N, K, x.device, prologue, override, scale_block_k=scale_bk or None,
                             weight_fp8=weight_scale is not None)
    config = config.for_operands(weight_scale is not None, x.dtype)
    block_m, block_ma, block_ks = _tiles(config, M, K, prologue)
    upcast = is_interpreted(x.device)
    _gemv_kernel[(cdiv(N, config.block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight,
        weight_scale if weight_scale is not None else weight,
        bias if bias is not None else weight, out, res_out if res_out is not None else out,
        M, N, K, float(eps), x.stride(0), residual.stride(0) if residual is not None else 0,
        weight_scale.shape[1] if scale_block is not None else 0,
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        W_FP8=weight_scale is not None, SCALE_BN=scale_bn, SCALE_BK=scale_bk,
        BLOCK_M=block_m, BLOCK_MA=block_ma, BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_KS=block_ks,
        USE_DOT=bool(config.use_dot), REDUCE_ONCE=bool(config.reduce_once and not config.use_dot), UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast or x.dtype == torch.float32 else "tf32", FP8_MATH=config.fp8_math,
        SWAP_AB=bool(config.fp8_math and config.swap_ab),
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
         weight_scale: Optional[torch.Tensor] = None, scale_block: Optional[tuple[int, int]] = None,
         config: Optional[GemvConfig] = None, override: GemvOverride = ()) -> torch.Tensor:
    """out = x @ weight.T (+ bias) for a decode batch, float32 accumulation.

    Args:
        x: [M, K], 0 <= M <= 16, float16/bfloat16/float32, last dim contiguous (row stride free).
        weight: [N, K] (nn.Linear layout), x's dtype or float8_e4m3fn, contiguous.
        bias: optional [N], x's dtype, contiguous; added in float32 before the final rounding.
        weight_scale: with an e4m3 weight, its float32 scales: [N] per output channel, or
            [cdiv(N, bn), cdiv(K, bk)] with ``scale_block``; None for a float weight.
        scale_block: (bn, bk) weight rows and inputs per block scale (bk a multiple of 16); None:
            per channel.
        config: launch config; None: ``gemv_config(M, N, K, x.device, override=override)``. Its
            ``fp8_math`` picks how an e4m3 weight meets x (WIDEN, E4M3_DOT, F16_WIDEN).
        override: ``GemvConfig`` field overrides of the default config (ignored with ``config``).

    Returns:
        out: a new [M, N] tensor in x's dtype.
    """
    _check_rows("x", x)
    _check_weights(x, x.shape[1], weight, bias, config, weight_scale, scale_block)
    return _launch(PLAIN, x, None, None, 0.0, weight, bias, None, config, override, weight_scale, scale_block)


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                  weight_scale: Optional[torch.Tensor] = None, scale_block: Optional[tuple[int, int]] = None,
                  config: Optional[GemvConfig] = None, override: GemvOverride = ()) -> torch.Tensor:
    """out = silu_and_mul(gate_up) @ weight.T (+ bias), the product rows never written to memory.

    Args:
        gate_up: [M, 2 * K] (gate | up), 0 <= M <= 16, float16/bfloat16/float32, last dim contiguous.
            The input row is a = dtype(dtype(silu(gate)) * up), rounded as ``layer_ops.silu_and_mul``.
        weight: [N, K], gate_up's dtype or float8_e4m3fn, contiguous.
        bias: optional [N], gate_up's dtype, contiguous.
        weight_scale: with an e4m3 weight, its float32 scales: [N] per output channel, or
            [cdiv(N, bn), cdiv(K, bk)] with ``scale_block``; None for a float weight.
        scale_block: (bn, bk) weight rows and inputs per block scale (bk a multiple of 16); None:
            per channel.
        config: launch config; None: ``gemv_config(M, N, K, gate_up.device, SILU_MUL, override)``.
        override: ``GemvConfig`` field overrides of the default config (ignored with ``config``).

    Returns:
        out: a new [M, N] tensor in gate_up's dtype.
    """
    _check_rows("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: last dim {gate_up.shape[1]} must be even (gate | up).")
    _check_weights(gate_up, gate_up.shape[1] // 2, weight, bias, config, weight_scale, scale_block)
    return _launch(SILU_MUL, gate_up, None, None, 0.0, weight, bias, None, config, override, weight_scale,
                   scale_block)


def add_rms_norm_gemv(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                      weight_scale: Optional[torch.Tensor] = None, scale_block: Optional[tuple[int, int]] = None,
                      config: Optional[GemvConfig] = None, override: GemvOverride = ()
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """out = rmsnorm(x + residual) @ weight.T (+ bias), and the residual sum.

    Args:
        x: [M, K], 0 <= M <= 16, float16/bfloat16/float32, last dim contiguous. Not modified.
        residual: optional [M, K] in x's dtype, last dim contiguous. Not modified.
        norm_weight: [K] RMSNorm weight, x's dtype, contiguous.
        eps: added to the mean square.
        weight: [N, K], x's dtype or float8_e4m3fn, contiguous.
        bias: optional [N], x's dtype, contiguous.
        weight_scale: with an e4m3 weight, its float32 scales: [N] per output channel, or
            [cdiv(N, bn), cdiv(K, bk)] with ``scale_block``; None for a float weight.
        scale_block: (bn, bk) weight rows and inputs per block scale (bk a multiple of 16); None:
            per channel.
        config: launch config; None: ``gemv_config(M, N, K, x.device, ADD_RMSNORM, override)``.
        override: ``GemvConfig`` field overrides of the default config (ignored with ``config``).

    Returns:
        (out, residual_out): out a new [M, N] tensor; residual_out = dtype(x + residual) as a new
        contiguous [M, K] tensor, or ``x`` itself (no copy) when residual is None. Rounding as
        ``layer_ops.add_rms_norm``: s = dtype(x + residual), a = dtype(nw * dtype(s * rsqrt(mean(s^2) + eps))).
    """
    M = _check_rows("x", x)
    K = x.shape[1]
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), shape=(M, K), device=x.device,
                     last_dim_contiguous=True)
    check_tensor("norm_weight", norm_weight, dtypes=(x.dtype,), shape=(K,), device=x.device, contiguous=True)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps: expected a float >= 0, got {eps!r}.")
    _check_weights(x, K, weight, bias, config, weight_scale, scale_block)
    res_out = torch.empty(M, K, dtype=x.dtype, device=x.device) if residual is not None else None   # [M, K]
    out = _launch(ADD_RMSNORM, x, residual, norm_weight, eps, weight, bias, res_out, config, override,
                  weight_scale, scale_block)
    return out, (res_out if res_out is not None else x)


# ----------------------------------------------------------------------------------------
# Torch twins (the test oracle)
# ----------------------------------------------------------------------------------------
def _fp8_math_of(fp8_math: int, weight_scale: Optional[torch.Tensor], dtype: torch.dtype) -> int:
    """``GemvConfig.for_operands``'s resolution of fp8_math."""
    return GemvConfig(fp8_math=fp8_math).for_operands(weight_scale is not None, dtype).fp8_math


def row_multipliers_ref(amax: torch.Tensor, fp8_math: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of the kernel's ``_row_multipliers``: (input multiplier, accumulator multiplier), float32 [M],
    from the rows' amax [M] (float32)."""
    if fp8_math == E4M3_DOT:
        # A tensor divisor: CUDA divides by a host scalar through its reciprocal, not by IEEE division.
        xs = amax.clamp(min=MIN_AMAX) / torch.tensor(FP8_MAX, dtype=torch.float32, device=amax.device)
        return 1.0 / xs, xs
    e = ((amax.float().view(torch.int32) >> 23) & 0xFF) - 127
    e = e.clamp(F16_MIN_EXP, F16_MAX_EXP)
    return (torch.ldexp(torch.ones_like(amax), (F16_TARGET_EXP - e).float()),
            torch.ldexp(torch.ones_like(amax), (e - F16_TARGET_EXP).float()))


def round_rows_ref(a: torch.Tensor, amax: torch.Tensor, fp8_math: int) -> torch.Tensor:
    """The float32 rows [M, K] the FP8 maths multiply the weight with: a [M, K] rounded as the kernel rounds
    it (E4M3_DOT: to e4m3 at the row scale, F16_WIDEN: to float16 at the row's power of two), scaled back;
    a itself (float32) for WIDEN. amax [M]: the rows' amax (or the kernel's bound of it)."""
    if fp8_math == WIDEN:
        return a.float()
    up, down = row_multipliers_ref(amax.float(), fp8_math)
    v = a.float() * up[:, None]                                                         # [M, K]
    q = v.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE) if fp8_math == E4M3_DOT else v.to(torch.float16)
    return q.float() * down[:, None]


def _linear_ref(a: torch.Tensor, amax: Optional[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor],
                weight_scale: Optional[torch.Tensor], scale_block: Optional[tuple[int, int]],
                fp8_math: int) -> torch.Tensor:
    """dtype(round_rows_ref(a) @ W.T + bias) in float32, W the (dequantized) weight; amax None: a's own."""
    math = _fp8_math_of(fp8_math, weight_scale, a.dtype)
    if amax is None:
        amax = a.float().abs().amax(dim=1)                                              # [M]
    b = bias.float() if bias is not None else None
    w = dequantize_fp8_weight(weight, weight_scale, scale_block) if weight_scale is not None else weight.float()
    return F.linear(round_rows_ref(a, amax, math), w, b).to(a.dtype)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
             weight_scale: Optional[torch.Tensor] = None, scale_block: Optional[tuple[int, int]] = None,
             fp8_math: int = WIDEN) -> torch.Tensor:
    """Twin of ``gemv``: a float32 ``F.linear`` rounded once to x's dtype; an e4m3 weight is first
    dequantized to float32 (``fp8_linear.dequantize_fp8_weight``), and with ``fp8_math`` E4M3_DOT /
    F16_WIDEN the rows are rounded as the kernel rounds them (``round_rows_ref``)."""
    return _linear_ref(x, None, weight, bias, weight_scale, scale_block, fp8_math)


def silu_mul_gemv_ref(gate_up: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                      weight_scale: Optional[torch.Tensor] = None, scale_block: Optional[tuple[int, int]] = None,
                      fp8_math: int = WIDEN) -> torch.Tensor:
    """Twin of ``silu_mul_gemv``: ``reference.silu_and_mul_ref`` (rounded to the dtype) then ``gemv_ref``."""
    return gemv_ref(silu_and_mul_ref(gate_up), weight, bias, weight_scale=weight_scale, scale_block=scale_block,
                    fp8_math=fp8_math)


def add_rms_norm_gemv_ref(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float,
                          weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                          weight_scale: Optional[torch.Tensor] = None, scale_block: Optional[tuple[int, int]] = None,
                          fp8_math: int = WIDEN) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of ``add_rms_norm_gemv``: ``reference.rms_norm_ref`` then the float32 product as ``gemv_ref``,
    the FP8 maths' row scales from the kernel's amax bound rstd * max |norm_weight * s|; returns
    (out, residual sum) (x itself when residual is None)."""
    if residual is None:
        n, s = rms_norm_ref(x, norm_weight, eps), x
    else:
        n, s = rms_norm_ref(x, norm_weight, eps, residual)
    sf = s.float()                                                                      # [M, K]
    rstd = torch.rsqrt(sf.pow(2).mean(dim=1) + eps)                                     # [M]
    amax = (norm_weight.float()[None, :] * sf).abs().amax(dim=1) * rstd                  # [M]
    return _linear_ref(n, amax, weight, bias, weight_scale, scale_block, fp8_math), s
