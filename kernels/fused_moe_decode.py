"""Fused MoE experts for a few (token, expert) pairs: two GEMV-style launches, no sorting.

The routed experts of an MoE layer (``engine.layers.moe.fused_moe_ref``'s semantics, as ``kernels.fused_moe``):

    out[t] = sum_k topk_weights[t, k] * (silu(x_t @ gate_e.T) * (x_t @ up_e.T)) @ w2[e].T,   e = topk_ids[t, k]

with ``w13`` [E, 2I, H] (each expert's gate rows, then its up rows) and ``w2`` [E, H, I]. At a decode step the
T * K pairs are few (batch 1 top-8: 8 pairs) and each expert has about one of them, so the sorted path's
work is mostly overhead: the sort and alignment are launches of their own, and every pair fills a
BLOCK_M-row block by itself. Here each pair reads its own expert's rows directly:

- Launch 1 (``_gate_up_kernel``): one program per (pair, BLOCK_N intermediate columns): the pair's row
  x[t] against the gate and up rows of w13[e], SiLU-and-mul in the epilogue -> act [T * K, I].
- Launch 2 (``_down_kernel``): one program per (token, BLOCK_N hidden columns): for each of the token's
  K pairs, act[pair] against w2[e]'s rows, times the routing weight, summed over the K pairs in the
  program (no atomics, deterministic; one loop over pairs x chunks, so the weight stream does not
  stop between pairs) -> out [T, H].

Pairs sharing an expert read its rows once each; the pair (stage 1) and the token (stage 2) are the
fastest grid axis, so those reads of one column block run side by side and meet in L2. The path reads
no index on the host and every size is a function of the shapes (CUDA-graph safe).

It is correct at any T; the engine takes it for calls of at most ``KernelPolicy.moe_decode_max_pairs``
(64) pairs. Up to there the pairs' programs fill the GPU by themselves (64 pairs x I / BLOCK_N
columns), and at about one pair per expert the sorted path has nothing to share: its blocks are one
real row and padding. Past it pairs share experts more and more (64 tokens top-8 of 128 experts: 4
pairs per expert), which the sorted path reads once per block and this one once per pair.

Numerics: as ``kernels.fused_moe`` (float32 accumulation; gate, up, silu(gate), the product, the down
output and that times the weight rounded to the input dtype, the K weighted rows summed in float32 and
rounded once). The torch twin is ``engine.layers.moe.fused_moe_ref``;
``tests/kernels/test_kernel_fused_moe_decode.py`` compares the two.

FP8 expert weights (W8A16; ``w13_scale`` / ``w2_scale`` given, as ``kernels.fused_moe``): w13 / w2 are
float8_e4m3fn and the weight multiplied by is W[e, n, k] = float(w[e, n, k]) * s, s = scale[e, n] per output
channel or scale[e, n // BN, k // BK] per (BN, BK) block. The e4m3 tile is widened in registers to the
activation dtype (tl.dot form) or float32 (elementwise form), the inner products run in float32, and the scale
is applied in float32: per channel to the finished inner products; per block, where a program's rows lie in
one row block (block_n divides BN, as 16 / 32 divide Qwen3's 128), to the input chunk before the product (any
chunk size; the scaled chunk rounded to the activation dtype for tl.dot), else to each K chunk's partial
products (the chunk, BLOCK_K, clamped to divide BK). The twin is ``fused_moe_ref`` on
``kernels.fused_moe.dequantize_fp8_experts``' weights.

Inner products, per launch (``MoEDecodeLaunch.use_dot``): tl.dot on the pair's row repeated to 16 rows
against the [BLOCK_N, BLOCK_K] weight tile, or an elementwise multiply accumulated in a [BLOCK_N,
BLOCK_K] float32 tile summed over its columns when the pair's inputs end (as ``kernels.gemv``'s two
forms; the down launch takes that sum at every chunk and keeps it on the pair's last).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

import triton
import triton.language as tl

from kernels.fused_moe import SCALE_BLOCK, SCALE_NONE, check_moe_inputs, scale_block_k, scale_mode
from kernels.utils import cdiv, check_pow2_field, is_interpreted, next_power_of_2


# ----------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------
@triton.jit
def _acc_init(BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr):
    """The float32 accumulator of one pair's [BLOCK_N] outputs: [16, BLOCK_N] for tl.dot (tl.dot's
    smallest M; every row the same), else [BLOCK_N, BLOCK_K] partial products summed by ``_acc_finish``.
    One return: a jit function's returns must share a type even where a constexpr branch is dead."""
    if USE_DOT:
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    return acc


@triton.jit
def _acc_step(acc, a, w, s, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, UPCAST: tl.constexpr,
              DOT_PRECISION: tl.constexpr, SCALE: tl.constexpr):
    """acc += a [BLOCK_K] (one input row chunk) times w [BLOCK_N, BLOCK_K] (weight rows), in float32;
    SCALE 2 (block scales): times s [BLOCK_N] float32 (the chunk's block scale of each row; s unused
    otherwise). An fp8 w (SCALE > 0) is widened to a's dtype for tl.dot (float32 under UPCAST)."""
    if USE_DOT:
        a2 = tl.broadcast_to(a[None, :], [16, BLOCK_K])
        if UPCAST:
            a2 = a2.to(tl.float32)
            w = w.to(tl.float32)
        elif SCALE != 0:
            w = w.to(a2.dtype)
        if SCALE == 2:
            acc += tl.dot(a2, tl.trans(w), input_precision=DOT_PRECISION) * s[None, :]
        else:
            acc += tl.dot(a2, tl.trans(w), input_precision=DOT_PRECISION)
    else:
        if SCALE == 2:
            acc += (w.to(tl.float32) * a.to(tl.float32)[None, :]) * s[:, None]
        else:
            acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    return acc


@triton.jit
def _scaled_input(a, s, USE_DOT: tl.constexpr, UPCAST: tl.constexpr):
    """SCALE 3: the input chunk a [BLOCK_K] times s [BLOCK_K], its inputs' block scales in the program's one
    row block (float32; rounded back to a's dtype for tl.dot, as every tl.dot operand is)."""
    x = a.to(tl.float32) * s
    if USE_DOT and not UPCAST:
        x = x.to(a.dtype)
    return x


@triton.jit
def _acc_finish(acc, USE_DOT: tl.constexpr):
    """[BLOCK_N] float32 inner products from ``_acc_step``'s accumulator (tl.dot: its row 0)."""
    if USE_DOT:
        y = tl.sum(tl.where((tl.arange(0, 16) == 0)[:, None], acc, 0.0), axis=0)
    else:
        y = tl.sum(acc, axis=1)
    return y


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, ws_ptr, ids_ptr, act_ptr, H, I, stride_x, stride_we, stride_se,
                    num_scale_kb, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    USE_DOT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr):
    """Semantics (dtype = act's dtype; float32 math unless rounded by dtype(.)):

        for pair p in [0, T * K), t = p // TOP_K, e = ids[p]:
            g, u = dtype(x[t] @ W13[e, :I].T), dtype(x[t] @ W13[e, I:2I].T)             # [I]
            act[p] = dtype(dtype(silu(g)) * u)

        W13[e, n, k] = w13[e, n, k]                                       SCALE == 0 (x's dtype)
                     = float(w13[e, n, k]) * ws[e, n]                     SCALE == 1 (w13 float8_e4m3fn)
                     = float(w13[e, n, k]) * ws[e, n // SCALE_BN, k // SCALE_BK]   SCALE == 2, 3 (e4m3)

    SCALE 3 computes the block form on the input side: a program's BLOCK_N gate rows (and its up rows) lie
    in one SCALE_BN row block (the wrapper's condition), so each input of a chunk is multiplied by its
    column block's scale before the product (any BLOCK_K; the scaled chunk is rounded to x's dtype for
    tl.dot), where SCALE 2 scales each chunk's partial products (BLOCK_K divides SCALE_BK).

    x: [T, H] rows at stride stride_x (last dim contiguous); w13: [E, 2I, H] contiguous (expert stride
    stride_we); ids: [T * K] flat expert ids; act: [T * K, I] contiguous. ws (SCALE > 0): float32 at
    expert stride stride_se, [E, 2I] per channel or [E, cdiv(2I, SCALE_BN), num_scale_kb = cdiv(H,
    SCALE_BK)] per block (BLOCK_K divides SCALE_BK); per-channel scales multiply the finished inner
    products, block scales each chunk's partial products.

    Grid: (T * K pairs, cdiv(I, BLOCK_N) column blocks); program (p, n) computes act[p, n-th block]
    over all of H (no split-K).
    """
    DTYPE: tl.constexpr = act_ptr.dtype.element_ty
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_x
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    w_expert = w13_ptr + expert * stride_we
    w_rows = w_expert + offs_n.to(tl.int64)[:, None] * H                               # [BLOCK_N, 1] gate rows
    u_rows = w_expert + (offs_n + I).to(tl.int64)[:, None] * H                        # [BLOCK_N, 1] up rows
    if SCALE != 0:
        s_base = ws_ptr + expert * stride_se
    if SCALE == 2:
        s_rows = s_base + (offs_n // SCALE_BN).to(tl.int64) * num_scale_kb               # [BLOCK_N] gate rows
        s_rows_up = s_base + ((offs_n + I) // SCALE_BN).to(tl.int64) * num_scale_kb      # [BLOCK_N] up rows
    if SCALE == 3:   # the program's rows lie in one scale row block (gate and up each)
        s_row = s_base + ((pid_n * BLOCK_N) // SCALE_BN).to(tl.int64) * num_scale_kb
        s_row_up = s_base + ((pid_n * BLOCK_N + I) // SCALE_BN).to(tl.int64) * num_scale_kb
    acc_g = _acc_init(BLOCK_N, BLOCK_K, USE_DOT)
    acc_u = _acc_init(BLOCK_N, BLOCK_K, USE_DOT)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        a = tl.load(x_row + offs_k, mask=k_ok, other=0.0)                               # [BLOCK_K]
        w_mask = n_ok[:, None] & k_ok[None, :]
        g = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)                    # [BLOCK_N, BLOCK_K]
        u = tl.load(u_rows + offs_k[None, :], mask=w_mask, other=0.0)
        a_g = a
        a_u = a
        if SCALE == 2:
            s_g = tl.load(s_rows + k0 // SCALE_BK, mask=n_ok, other=0.0)                # [BLOCK_N] float32
            s_u = tl.load(s_rows_up + k0 // SCALE_BK, mask=n_ok, other=0.0)
        else:
            s_g = 1.0
            s_u = 1.0
        if SCALE == 3:
            a_g = _scaled_input(a, tl.load(s_row + offs_k // SCALE_BK, mask=k_ok, other=0.0), USE_DOT, UPCAST)
            a_u = _scaled_input(a, tl.load(s_row_up + offs_k // SCALE_BK, mask=k_ok, other=0.0), USE_DOT, UPCAST)
        acc_g = _acc_step(acc_g, a_g, g, s_g, BLOCK_K, USE_DOT, UPCAST, DOT_PRECISION, SCALE)
        acc_u = _acc_step(acc_u, a_u, u, s_u, BLOCK_K, USE_DOT, UPCAST, DOT_PRECISION, SCALE)
    gate = _acc_finish(acc_g, USE_DOT)
    up = _acc_finish(acc_u, USE_DOT)
    if SCALE == 1:
        gate *= tl.load(s_base + offs_n, mask=n_ok, other=0.0)
        up *= tl.load(s_base + I + offs_n, mask=n_ok, other=0.0)
    gate = gate.to(DTYPE).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    y = (act * up.to(DTYPE).to(tl.float32)).to(DTYPE)
    tl.store(act_ptr + pair.to(tl.int64) * I + offs_n, y, mask=n_ok)


@triton.jit
def _down_kernel(act_ptr, w2_ptr, ws_ptr, ids_ptr, topk_w_ptr, out_ptr, H, I, stride_we, stride_se,
                 num_scale_kb, TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, UPCAST: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, SCALE: tl.constexpr, SCALE_BN: tl.constexpr,
                 SCALE_BK: tl.constexpr):
    """Semantics (dtype = out's dtype; float32 math unless rounded by dtype(.)):

        for token t in [0, T):
            s = 0 (float32)
            for k in [0, TOP_K), p = t * TOP_K + k, e = ids[p]:
                y = dtype(act[p] @ W2[e].T)                                               # [H]
                s += dtype(y * topk_w[p])
            out[t] = dtype(s)

        W2[e, n, k] = w2[e, n, k]                                        SCALE == 0 (act's dtype)
                    = float(w2[e, n, k]) * ws[e, n]                      SCALE == 1 (w2 float8_e4m3fn)
                    = float(w2[e, n, k]) * ws[e, n // SCALE_BN, k // SCALE_BK]   SCALE == 2, 3 (e4m3)

    SCALE 3: the block form on the input side, as ``_gate_up_kernel``'s (a program's rows in one row block).

    act: [T * K, I] contiguous; w2: [E, H, I] contiguous (expert stride stride_we); ids, topk_w:
    [T * K] flat expert ids and routing weights (any float dtype, read as float32); out: [T, H]
    contiguous. TOP_K_P2: next power of two >= TOP_K. ws (SCALE > 0): float32 at expert stride
    stride_se, [E, H] per channel (the token's K pairs' scale rows read before the loop, with the ids)
    or [E, cdiv(H, SCALE_BN), num_scale_kb = cdiv(I, SCALE_BK)] per block (BLOCK_K divides SCALE_BK);
    per-channel scales multiply a pair's finished inner products, block scales each chunk's partial
    products.

    Grid: (T tokens, cdiv(H, BLOCK_N) column blocks). Program (t, n) runs one loop over the token's
    K pairs x cdiv(I, BLOCK_K) chunks (not a loop per pair: the weight loads stream from one pair's
    expert into the next without draining the pipeline); the token's expert ids and weights are read
    once, before it, so no load in the loop waits on another. A pair's sum is finished on its last
    chunk (masked adds elsewhere, so no branch in the loop).
    """
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    token = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    w_cols = offs_n.to(tl.int64)[:, None] * I                                           # [BLOCK_N, 1]
    offs_p = tl.arange(0, TOP_K_P2)
    p_ok = offs_p < TOP_K
    first_pair = token * TOP_K
    experts = tl.load(ids_ptr + first_pair + offs_p, mask=p_ok, other=0).to(tl.int64)   # [TOP_K_P2]
    weights = tl.load(topk_w_ptr + first_pair + offs_p, mask=p_ok, other=0.0).to(tl.float32)
    if SCALE == 1:
        pair_scales = tl.load(ws_ptr + experts[:, None] * stride_se + offs_n[None, :],
                              mask=p_ok[:, None] & n_ok[None, :], other=0.0)            # [TOP_K_P2, BLOCK_N]
    if SCALE == 2:
        s_cols = (offs_n // SCALE_BN).to(tl.int64) * num_scale_kb                       # [BLOCK_N]
    if SCALE == 3:
        s_row = ((pid_n * BLOCK_N) // SCALE_BN).to(tl.int64) * num_scale_kb
    num_chunks = tl.cdiv(I, BLOCK_K)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc = _acc_init(BLOCK_N, BLOCK_K, USE_DOT)
    for it in range(0, TOP_K * num_chunks):
        k = it // num_chunks
        chunk = it - k * num_chunks
        is_k = offs_p == k
        expert = tl.sum(tl.where(is_k, experts, 0))
        offs_k = chunk * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < I
        a = tl.load(act_ptr + (first_pair + k).to(tl.int64) * I + offs_k, mask=k_ok, other=0.0)   # [BLOCK_K]
        w = tl.load(w2_ptr + expert * stride_we + w_cols + offs_k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)                       # [BLOCK_N, BLOCK_K]
        if SCALE == 2:
            s_w = tl.load(ws_ptr + expert * stride_se + s_cols + (chunk * BLOCK_K) // SCALE_BK, mask=n_ok,
                          other=0.0)                                                     # [BLOCK_N] float32
        else:
            s_w = 1.0
        if SCALE == 3:   # the program's rows lie in one scale row block
            s_in = tl.load(ws_ptr + expert * stride_se + s_row + offs_k // SCALE_BK, mask=k_ok, other=0.0)
            a = _scaled_input(a, s_in, USE_DOT, UPCAST)
        acc = _acc_step(acc, a, w, s_w, BLOCK_K, USE_DOT, UPCAST, DOT_PRECISION, SCALE)
        last = chunk == num_chunks - 1
        y = _acc_finish(acc, USE_DOT)
        if SCALE == 1:
            y *= tl.sum(tl.where(is_k[:, None], pair_scales, 0.0), axis=0)
        y = y.to(DTYPE).to(tl.float32)
        weighted = (y * tl.sum(tl.where(is_k, weights, 0.0))).to(DTYPE).to(tl.float32)
        total += tl.where(last, weighted, 0.0)
        acc = tl.where(last, 0.0, acc)
    tl.store(out_ptr + token.to(tl.int64) * H + offs_n, total.to(DTYPE), mask=n_ok)


# ----------------------------------------------------------------------------------------
# Launch configs
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoEDecodeLaunch:
    """Launch parameters of one of the two launches."""

    block_n: int = 32
    """Output columns per program (power of two in [1, 256], >= 16 with use_dot)."""
    block_k: int = 256
    """Inputs per inner step, weight tile [block_n, block_k] (power of two in [16, 4096])."""
    num_warps: int = 4
    """Warps per program (power of two in [1, 16])."""
    num_stages: int = 3
    """Software-pipelining depth of the inner loop (>= 1)."""
    use_dot: int = 1
    """1: tl.dot on the input row repeated to 16 rows; 0: elementwise products summed after the loop."""

    def __post_init__(self) -> None:
        if self.use_dot not in (0, 1) or isinstance(self.use_dot, (bool, float)):
            raise ValueError(f"MoEDecodeLaunch.use_dot: {self.use_dot!r} must be 0 or 1.")
        check_pow2_field("MoEDecodeLaunch", "block_n", self.block_n, 16 if self.use_dot else 1, 256)
        check_pow2_field("MoEDecodeLaunch", "block_k", self.block_k, 16, 4096)
        check_pow2_field("MoEDecodeLaunch", "num_warps", self.num_warps, 1, 16)
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"MoEDecodeLaunch.num_stages: {self.num_stages!r} must be an int >= 1.")


@dataclass(frozen=True)
class MoEDecodeConfig:
    """Launch parameters of the decode path: one ``MoEDecodeLaunch`` per launch."""

    gate_up: MoEDecodeLaunch = field(default_factory=MoEDecodeLaunch)
    """Launch 1: (pair, intermediate columns) programs over w13."""
    down: MoEDecodeLaunch = field(default_factory=MoEDecodeLaunch)
    """Launch 2: (token, hidden columns) programs over w2, the K pairs looped inside."""

    def __post_init__(self) -> None:
        for name in ("gate_up", "down"):
            if not isinstance(getattr(self, name), MoEDecodeLaunch):
                raise ValueError(f"MoEDecodeConfig.{name}: expected a MoEDecodeLaunch, "
                                 f"got {type(getattr(self, name)).__name__}.")


def moe_decode_config(num_tokens: int, hidden: int, intermediate: int, top_k: int,
                      device: Optional[torch.device] = None, fp8: bool = False) -> MoEDecodeConfig:
    """The default config of a decode-path call.

    Args:
        num_tokens, hidden, intermediate, top_k: T, H, I, K.
        device: where it runs; a CPU device means the interpreter (64-wide tiles: few programs). None: CUDA.
        fp8: e4m3 weights.

    Tuned on an H100 at the Qwen3-30B-A3B shape (H 2048, I 768, K 8;
    ``benchmarks/sweeps/moe_decode_sweep.py``, ``--fp8`` for e4m3 block-scaled weights, times the grid on the
    target GPU): narrow tiles of elementwise products for gate|up (8 columns at 1-2 tokens, 16 above: many
    programs over few pairs); for down, e4m3 takes elementwise 4 x 256 tiles at 1-2 tokens and 32 x 128 above,
    bfloat16 tl.dot 16 x 512 then 32 x 128 on two warps (RESULTS.md "Launch configs": the times per call).
    """
    if device is not None and is_interpreted(device):
        small = MoEDecodeLaunch(block_n=64, block_k=64, num_warps=4, num_stages=1, use_dot=0)
        return MoEDecodeConfig(gate_up=small, down=small)
    few = num_tokens <= 2
    gate_up = MoEDecodeLaunch(block_n=8 if few else 16, block_k=256, num_warps=4, num_stages=3, use_dot=0)
    if fp8:
        down = MoEDecodeLaunch(4, 256, 4, 3, 0) if few else MoEDecodeLaunch(32, 128, 4, 3, 0)
    else:
        down = MoEDecodeLaunch(16, 512, 2, 3, 1) if few else MoEDecodeLaunch(32, 128, 2, 3, 1)
    return MoEDecodeConfig(gate_up=gate_up, down=down)


# ----------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------
def _scale_args(w: torch.Tensor, w_scale: Optional[torch.Tensor], mode: int) -> tuple[torch.Tensor, int, int]:
    """(ws, stride_se, num_scale_kb) of one launch: the scales, their expert stride and K blocks (w itself,
    never read, without scales)."""
    if mode == SCALE_NONE:
        return w, 0, 0
    return w_scale, w_scale.stride(0), w_scale.shape[2] if mode == SCALE_BLOCK else 0


SCALE_BLOCK_INPUT = 3
"""The decode kernels' SCALE for block scales applied to the input chunk (the kernels' docstrings)."""


def _block_form(mode: int, launch: MoEDecodeLaunch, scale_block: Optional[tuple[int, int]], rows_offset: int
                ) -> tuple[int, int]:
    """(SCALE, BLOCK_K) of one launch: block scales go on the input side (SCALE_BLOCK_INPUT, the launch's
    block_k) where every program's rows lie in one scale row block (block_n divides the block's rows, and
    so does ``rows_offset``, gate|up's I); else as given, block_k capped to divide the block's columns."""
    if mode == SCALE_BLOCK and scale_block[0] % launch.block_n == 0 and rows_offset % scale_block[0] == 0:
        return SCALE_BLOCK_INPUT, launch.block_k
    return mode, scale_block_k(launch.block_k, scale_block)


def fused_moe_decode_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, config: Optional[MoEDecodeConfig] = None, *,
                            w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                            scale_block: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """The routed experts' output, sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]), each pair
    reading its own expert (the module docstring).

    Args:
        hidden: [T, H] float16/bfloat16/float32, last dim contiguous (row stride free).
        w13: [E, 2 * I, H] each expert's gate rows then its up rows; hidden's dtype (float8_e4m3fn with
            scales) and device, contiguous.
        w2: [E, H, I] each expert's down projection; as w13.
        topk_weights: [T, K] routing weights, any float dtype (read as float32).
        topk_ids: [T, K] int32/int64 expert ids in [0, E) (not checked on the host: no sync).
        config: launch config; None: ``moe_decode_config(T, H, I, K, hidden.device)``. With block scales
            each launch's block_k is capped to divide BK (``kernels.fused_moe.scale_block_k``).
        w13_scale, w2_scale, scale_block: FP8 weights' scales, as ``kernels.fused_moe.fused_moe_triton``'s:
            float32, contiguous, per channel [E, 2 * I] / [E, H], or per (BN, BK) = scale_block block
            [E, cdiv(2 * I, BN), cdiv(H, BK)] / [E, cdiv(H, BN), cdiv(I, BK)]; both scales or neither.

    Returns:
        A new contiguous [T, H] tensor in hidden's dtype (``engine.layers.moe.fused_moe_ref``'s result; with
        FP8 weights, on ``kernels.fused_moe.dequantize_fp8_experts``' weights).

    No host synchronization and every buffer size is a function of the shapes (CUDA-graph safe).
    Buffer: the [T * K, I] SiLU-and-mul products.
    """
    T, H, _, inter, top_k = check_moe_inputs(hidden, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale,
                                             w2_scale=w2_scale, scale_block=scale_block)
    scale_block = None if scale_block is None else tuple(scale_block)
    if config is None:
        config = moe_decode_config(T, H, inter, top_k, hidden.device, fp8=w13_scale is not None)
    elif not isinstance(config, MoEDecodeConfig):
        raise ValueError(f"config: expected a MoEDecodeConfig, got {type(config).__name__}.")
    out = torch.empty(T, H, dtype=hidden.dtype, device=hidden.device)                  # [T, H]
    if T == 0 or H == 0:
        return out.zero_()
    num_pairs = T * top_k
    ids = topk_ids.reshape(-1).contiguous()                                              # [T*K] pair -> expert
    topk_w = topk_weights.reshape(-1).contiguous()                                       # [T*K]
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)       # [T*K, I]
    upcast = is_interpreted(hidden.device)
    precision = "ieee" if upcast or hidden.dtype == torch.float32 else "tf32"
    c1, c2 = config.gate_up, config.down
    mode = scale_mode(w13_scale, scale_block)
    bn, bk = scale_block if mode == SCALE_BLOCK else (1, 1)
    ws13, se13, kb13 = _scale_args(w13, w13_scale, mode)
    ws2, se2, kb2 = _scale_args(w2, w2_scale, mode)
    mode1, block_k1 = _block_form(mode, c1, scale_block, rows_offset=inter)
    mode2, block_k2 = _block_form(mode, c2, scale_block, rows_offset=0)
    _gate_up_kernel[(num_pairs, cdiv(inter, c1.block_n))](
        hidden, w13, ws13, ids, act, H, inter, hidden.stride(0), w13.stride(0), se13, kb13,
        TOP_K=top_k, BLOCK_N=c1.block_n, BLOCK_K=block_k1,
        USE_DOT=bool(c1.use_dot), UPCAST=upcast, DOT_PRECISION=precision, SCALE=mode1, SCALE_BN=bn,
        SCALE_BK=bk, num_warps=c1.num_warps, num_stages=c1.num_stages)
    _down_kernel[(T, cdiv(H, c2.block_n))](
        act, w2, ws2, ids, topk_w, out, H, inter, w2.stride(0), se2, kb2,
        TOP_K=top_k, TOP_K_P2=next_power_of_2(top_k), BLOCK_N=c2.block_n,
        BLOCK_K=block_k2, USE_DOT=bool(c2.use_dot), UPCAST=upcast,
        DOT_PRECISION=precision, SCALE=mode2, SCALE_BN=bn, SCALE_BK=bk,
        num_warps=c2.num_warps, num_stages=c2.num_stages)
    return out
