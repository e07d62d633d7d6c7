"""Fused MoE experts: two grouped-GEMM launches over the (token, expert) pairs sorted by expert.

The routed experts of an MoE layer (``engine.layers.moe.fused_moe``'s semantics):

    out[t] = sum_k topk_weights[t, k] * (silu(x_t @ gate_e.T) * (x_t @ up_e.T)) @ w2[e].T,   e = topk_ids[t, k]

with ``w13`` [E, 2I, H] (each expert's gate rows, then its up rows) and ``w2`` [E, H, I]. Three steps,
none of which reads anything on the host (so the whole call can be captured in a CUDA graph; every
size is a function of the shapes alone):

- ``moe_align(topk_ids, num_experts, block_m)`` (torch ops): the T * K pairs (pair p = t * K + k)
  sorted by expert, each expert's segment padded to a multiple of ``block_m`` with the sentinel
  T * K, so every block of ``block_m`` sorted slots belongs to one expert. The padded length is
  bounded by T * K + E * (block_m - 1), which fixes the buffer sizes; blocks past the real ones
  are marked expert -1 and their programs exit at once.
- Stage 1 (``_grouped_gemm_kernel`` with GATHER, SILU_MUL): slot s of block b gathers the row
  x[pair // K] and multiplies it by the gate and up rows of w13[expert_of_block[b]]; the epilogue
  applies SiLU-and-mul and writes the [I] product row to intermediate[s] ([P, I]).
- Stage 2 (the same kernel with SCATTER, MUL_WEIGHT): intermediate[s] @ w2[e].T, scaled by
  topk_weights[pair], written to row ``pair`` of a [T * K, H] buffer; ``.sum`` over K gives
  [T, H] (deterministic: no atomics).

FP8 expert weights (W8A16; ``w13_scale`` / ``w2_scale`` given): w13 / w2 are float8_e4m3fn and the
weight both GEMMs multiply by is the dequantized one, W[e, n, k] = float(w[e, n, k]) * s with
s = scale[e, n] (per output channel) or s = scale[e, n // BN, k // BK] (``scale_block=(BN, BK)``,
as Qwen3 / DeepSeek FP8 checkpoints ship, e.g. 128 x 128). The activations stay in hidden's dtype:
the kernel loads the e4m3 tile, widens it to the activation dtype in registers (exact: every e4m3
value is a float16 / bfloat16 value), dots in float32 and applies the scale in float32: a
per-channel scale multiplies the finished accumulator once, a block scale each K tile's partial
product (the K tile, BLOCK_K, is clamped to divide BK). The torch twin is ``fused_moe_ref`` on
``dequantize_fp8_experts``' weights.

Numerics: float32 accumulation in both GEMMs; the intermediate values are rounded to the input
dtype where ``fused_moe_ref`` rounds them (gate and up, silu(gate), the product; the down output,
then that times the weight), and the K weighted rows are summed in float32 and rounded once
(``fused_moe_ref`` adds them in the dtype, token row by token row). The torch twin is
``engine.layers.moe.fused_moe_ref``; ``tests/kernels/test_kernel_fused_moe.py`` compares the two.

Launch configs: ``fused_moe_config(num_tokens, num_experts, hidden, intermediate, top_k, device)``
(defaults as vLLM's untuned ``fused_moe`` config); the wrapper takes an explicit ``config=``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

import triton
import triton.language as tl

from kernels.fp8_linear import dequantize_fp8_weight
from kernels.utils import FLOAT_DTYPES, cdiv, check_int, check_pow2_field, check_tensor, is_interpreted

FP8_DTYPE = torch.float8_e4m3fn
SCALE_NONE, SCALE_CHANNEL, SCALE_BLOCK = 0, 1, 2
"""Values of the kernels' SCALE constexpr: float weights, fp8 weights with per-output-channel scales
[E, N], fp8 weights with (SCALE_BN, SCALE_BK) block scales [E, cdiv(N, SCALE_BN), cdiv(K, SCALE_BK)]."""


# ----------------------------------------------------------------------------------------
# Alignment (torch, on the device, no host read)
# ----------------------------------------------------------------------------------------
def moe_align_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """P, the padded length of ``moe_align``'s sorted pairs: num_pairs + num_experts * (block_m - 1)
    rounded up to block_m (the worst case; the real padded length is ``num_valid`` <= P)."""
    return cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs sorted by expert, each expert's segment padded to a block_m multiple.

    Args:
        topk_ids: [T, K] int expert ids, each in [0, num_experts) (not checked: that would read the
            device on the host). Pair p = t * K + k.
        num_experts: E.
        block_m: the segment granularity (the kernel's BLOCK_M), >= 1.

    Returns:
        (sorted_pair_ids, expert_of_block, num_valid), all on topk_ids' device, int64:
        sorted_pair_ids [P] (P = ``moe_align_size(T * K, E, block_m)``): expert 0's pairs in
            ascending order, padded with the sentinel T * K to a multiple of block_m, then expert
            1's, ...; an expert with no pairs has no slots. Slots past num_valid hold the sentinel.
        expert_of_block [P / block_m]: the expert of each block of block_m slots, -1 past num_valid.
        num_valid [1]: the padded length of the real segments (a multiple of block_m).

    No host synchronization: counts by ``scatter_add_`` (``torch.bincount`` reads its max on the
    host on CUDA), a stable argsort, cumsums, a scatter and a searchsorted.
    """
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64))
    check_int("num_experts", num_experts, min_value=1)
    check_int("block_m", block_m, min_value=1)
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    size = moe_align_size(num_pairs, num_experts, block_m)
    flat = topk_ids.reshape(-1).to(torch.int64)                                       # [T*K] pair -> expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))                              # [E]
    padded = (counts + (block_m - 1)) // block_m * block_m                           # [E]
    seg_end = torch.cumsum(padded, 0)                                                # [E] padded segment ends
    seg_start = seg_end - padded
    order = torch.argsort(flat, stable=True)                                         # [T*K] sorted rank -> pair
    sorted_experts = flat[order]
    rank_start = torch.cumsum(counts, 0) - counts                                    # [E] unpadded starts
    dest = seg_start[sorted_experts] + torch.arange(num_pairs, device=device) - rank_start[sorted_experts]
    sorted_pair_ids = torch.full((size,), num_pairs, dtype=torch.int64, device=device)
    sorted_pair_ids.scatter_(0, dest, order)
    block_starts = torch.arange(0, size, block_m, device=device)                     # [P / block_m]
    expert_of_block = torch.searchsorted(seg_end, block_starts, right=True)          # first e with end > start
    expert_of_block = torch.where(expert_of_block < num_experts, expert_of_block, -1)
    return sorted_pair_ids, expert_of_block, seg_end[-1:].clone()


# ----------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------
@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, ws_ptr, out_ptr, sorted_pair_ptr, expert_of_block_ptr, num_valid_ptr,
                         topk_w_ptr, N, K, num_pairs, num_experts, stride_a, stride_we, stride_se,
                         num_scale_kb, stride_out,
                         TOP_K: tl.constexpr, GATHER: tl.constexpr, SILU_MUL: tl.constexpr,
                         SCATTER: tl.constexpr, MUL_WEIGHT: tl.constexpr, LORA: tl.constexpr,
                         ADD_OUT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr):
    """Semantics (dtype = out's dtype; float32 math unless rounded by dtype(.); W: w dequantized, below):

        for b with b * BLOCK_M < num_valid, g = expert_of_block[b] (its group),
                e = g - num_experts if LORA (blocks with e < 0 skipped) else g % num_experts:
            for slot s in block b with pair = sorted_pair[s] < num_pairs:
                row = a[pair // TOP_K] if GATHER else a[s]                              # [K]
                if SILU_MUL:  g, u = dtype(row @ W[e, :N].T), dtype(row @ W[e, N:2N].T)
                              y = dtype(dtype(silu(g)) * u)                              # [N]
                else:         y = dtype(row @ W[e].T)                                    # [N]
                if MUL_WEIGHT: y = dtype(y * topk_w[pair])
                if ADD_OUT:    y = dtype(out[pair if SCATTER else s] + y)
                out[pair if SCATTER else s] = y

        W[e, n, k] = w[e, n, k]                                      SCALE == 0 (w in a's dtype)
                   = float(w[e, n, k]) * ws[e, n]                    SCALE == 1 (w float8_e4m3fn)
                   = float(w[e, n, k]) * ws[e, n // SCALE_BN, k // SCALE_BK]   SCALE == 2 (e4m3)

    w: [E, N (2N with SILU_MUL), K] with expert stride stride_we, rows contiguous; a / out rows at
    strides stride_a / stride_out (last dim contiguous); topk_w: [num_pairs] flat routing weights.
    ws (SCALE > 0): float32 scales at expert stride stride_se, [E, N (2N)] per channel or
    [E, cdiv(N (2N), SCALE_BN), num_scale_kb = cdiv(K, SCALE_BK)] per block, rows contiguous. An fp8
    tile is widened to a's dtype in registers (float32 under UPCAST) and dotted in float32; a
    per-channel scale multiplies the finished accumulators (gate and up each by their rows' scales),
    a block scale each K tile's partial product (BLOCK_K divides SCALE_BK).
    Slots holding the sentinel (pair >= num_pairs) are neither read nor written. Groups are the
    experts themselves for a plain MoE call; ``kernels.fused_moe_lora`` sorts the pairs by
    (adapter slot, expert) groups, g = (slot + 1) * num_experts + e for an adapted pair, so the base
    GEMM reads w[g % num_experts] and the LoRA shrink / expand (LORA) read the (slot, expert) weights
    w[slot * num_experts + e].

    Grid: one program per (block of BLOCK_M sorted slots, BLOCK_N output columns), over the
    worst-case P / BLOCK_M blocks, GROUP_M blocks of slots swizzled together along the columns
    (L2 reuse of the A rows); programs of blocks past num_valid return at once.
    """
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(tl.num_programs(0), tl.cdiv(N, BLOCK_N))
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_rows
    pid_n = (pid % group) // group_rows

    num_valid = tl.load(num_valid_ptr)
    if pid_m * BLOCK_M >= num_valid:
        return
    expert = tl.load(expert_of_block_ptr + pid_m)
    if expert < 0:
        return
    if LORA:
        expert = expert - num_experts
        if expert < 0:
            return
    else:
        expert = expert % num_experts

    offs_s = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ptr + offs_s)                                          # [BLOCK_M]
    row_ok = pair < num_pairs
    if GATHER:
        a_rows = pair // TOP_K
    else:
        a_rows = offs_s.to(tl.int64)
    a_rows = tl.where(row_ok, a_rows, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    w_rows = w_base + offs_n.to(tl.int64)[:, None] * K                                # [BLOCK_N, 1]

    if SCALE != 0:
        s_base = ws_ptr + expert.to(tl.int64) * stride_se
    if SCALE == 2:
        s_rows = s_base + (offs_n // SCALE_BN).to(tl.int64) * num_scale_kb            # [BLOCK_N] gate rows
        s_rows_up = s_base + ((offs_n + N) // SCALE_BN).to(tl.int64) * num_scale_kb   # [BLOCK_N] up rows

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + offs_k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)                  # [BM, BK]
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)                 # [BN, BK]
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        elif SCALE != 0:
            w = w.to(a.dtype)                                                         # e4m3 -> a's dtype
        if SCALE == 2:
            s_tile = tl.load(s_rows + k0 // SCALE_BK, mask=n_ok, other=0.0)           # [BN] float32
            acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION) * s_tile[None, :]
        else:
            acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
        if SILU_MUL:
            u = tl.load(w_rows + N * K + offs_k[None, :], mask=w_mask, other=0.0)     # up rows [BN, BK]
            if UPCAST:
                u = u.to(tl.float32)
            elif SCALE != 0:
                u = u.to(a.dtype)
            if SCALE == 2:
                s_tile_up = tl.load(s_rows_up + k0 // SCALE_BK, mask=n_ok, other=0.0)
                acc_up += tl.dot(a, tl.trans(u), input_precision=DOT_PRECISION) * s_tile_up[None, :]
            else:
                acc_up += tl.dot(a, tl.trans(u), input_precision=DOT_PRECISION)
    if SCALE == 1:
        acc *= tl.load(s_base + offs_n, mask=n_ok, other=0.0)[None, :]
        if SILU_MUL:
            acc_up *= tl.load(s_base + N + offs_n, mask=n_ok, other=0.0)[None, :]

    if SILU_MUL:
        g = acc.to(DTYPE).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
        y = (act * acc_up.to(DTYPE).to(tl.float32)).to(DTYPE)
    else:
        y = acc.to(DTYPE)
    if MUL_WEIGHT:
        rw = tl.load(topk_w_ptr + tl.where(row_ok, pair, 0), mask=row_ok, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) * rw[:, None]).to(DTYPE)
    if SCATTER:
        out_rows = tl.where(row_ok, pair, 0).to(tl.int64)
    else:
        out_rows = offs_s.to(tl.int64)
    out_ptrs = out_ptr + out_rows[:, None] * stride_out + offs_n[None, :]
    out_mask = row_ok[:, None] & n_ok[None, :]
    if ADD_OUT:
        y = (tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32) + y.to(tl.float32)).to(DTYPE)
    tl.store(out_ptrs, y, mask=out_mask)


# ----------------------------------------------------------------------------------------
# Launch configs
# ----------------------------------------------------------------------------------------
def _check_pow2(name: str, value: object, min_value: int, max_value: int) -> None:
    check_pow2_field("FusedMoEConfig", name, value, min_value, max_value)


@dataclass(frozen=True)
class FusedMoEConfig:
    """Launch parameters of the two grouped-GEMM launches (the same tiles for both)."""

    block_m: int = 64
    """Sorted slots per program, and ``moe_align``'s segment granularity (power of two in [16, 256])."""
    block_n: int = 64
    """Output columns per program (power of two in [16, 256])."""
    block_k: int = 32
    """Inputs per inner step (power of two in [16, 256])."""
    group_m: int = 8
    """Slot blocks swizzled together along the columns (>= 1)."""
    num_warps: int = 4
    """Warps per program (power of two in [1, 16])."""
    num_stages: int = 3
    """Software-pipelining depth of the K loop (>= 1)."""

    def __post_init__(self) -> None:
        _check_pow2("block_m", self.block_m, 16, 256)
        _check_pow2("block_n", self.block_n, 16, 256)
        _check_pow2("block_k", self.block_k, 16, 256)
        _check_pow2("num_warps", self.num_warps, 1, 16)
        for name in ("group_m", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FusedMoEConfig.{name}: {value!r} must be an int >= 1.")


def fused_moe_config(num_tokens: int, num_experts: int, hidden: int, intermediate: int, top_k: int,
                     device: Optional[torch.device] = None) -> FusedMoEConfig:
    """The default config of a fused MoE call.

    Args:
        num_tokens, num_experts, hidden, intermediate, top_k: T, E, H, I, K.
        device: where it runs; a CPU device means the interpreter (16-wide tiles: few, cheap
            programs). None: CUDA.

    NOTE: not tuned here: vLLM's untuned default (``get_default_config``): at most E tokens
    (decode: about one pair per expert) block 16 x 32 x 64, group 1; else 64 x 64 x 32, group 8.
    A sweep on the target GPU (per E, H, I and token bucket, as vLLM's tuned JSON configs) should
    replace it.
    """
    if device is not None and is_interpreted(device):
        return FusedMoEConfig(block_m=16, block_n=32, block_k=32, group_m=1, num_warps=4, num_stages=1)
    if num_tokens <= num_experts:
        return FusedMoEConfig(block_m=16, block_n=32, block_k=64, group_m=1, num_warps=4, num_stages=3)
    return FusedMoEConfig(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=3)


# ----------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------
def scale_mode(w_scale: Optional[torch.Tensor], scale_block: Optional[tuple[int, int]]) -> int:
    """The kernels' SCALE constexpr of a weight's scales: SCALE_NONE / SCALE_CHANNEL / SCALE_BLOCK."""
    if w_scale is None:
        return SCALE_NONE
    return SCALE_CHANNEL if scale_block is None else SCALE_BLOCK


def scale_block_k(block_k: int, scale_block: Optional[tuple[int, int]]) -> int:
    """A K tile that divides the scale blocks' BK: block_k capped at the largest power of two dividing BK
    (>= 16 once ``check_fp8_scales`` has passed); block_k itself without block scales."""
    if scale_block is None:
        return block_k
    bk = scale_block[1]
    return min(block_k, bk & -bk)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_pair_ids: torch.Tensor,
                 expert_of_block: torch.Tensor, num_valid: torch.Tensor, topk_w: torch.Tensor, N: int, K: int,
                 num_pairs: int, top_k: int, gather: bool, silu_mul: bool, config: FusedMoEConfig, *,
                 num_experts: int, scatter: bool, mul_weight: bool, lora: bool = False,
                 add_out: bool = False, w_scale: Optional[torch.Tensor] = None,
                 scale_block: Optional[tuple[int, int]] = None) -> None:
    """One launch of ``_grouped_gemm_kernel`` (its docstring gives the semantics; arguments unchecked:
    ``fused_moe_triton`` and ``kernels.fused_moe_lora.fused_moe_lora_triton`` check theirs). w may be a
    strided view whose rows are contiguous (row stride K), e.g. one slice of stacked LoRA B. With
    ``w_scale`` (float32, contiguous) w is float8_e4m3fn with per-channel scales [E, N (2N)], or block
    scales [E, cdiv(N (2N), BN), cdiv(K, BK)] with ``scale_block=(BN, BK)``; the K tile is then clamped
    to divide BK (``scale_block_k``)."""
    upcast = is_interpreted(a.device)
    mode = scale_mode(w_scale, scale_block)
    bn, bk = scale_block if mode == SCALE_BLOCK else (1, 1)
    grid = (expert_of_block.numel() * cdiv(N, config.block_n),)
    _grouped_gemm_kernel[grid](
        a, w, w if w_scale is None else w_scale, out, sorted_pair_ids, expert_of_block, num_valid, topk_w,
        N, K, num_pairs, num_experts, a.stride(0), w.stride(0), 0 if w_scale is None else w_scale.stride(0),
        w_scale.shape[2] if mode == SCALE_BLOCK else 0, out.stride(0),
        TOP_K=top_k, GATHER=gather, SILU_MUL=silu_mul, SCATTER=scatter, MUL_WEIGHT=mul_weight, LORA=lora,
        ADD_OUT=add_out,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=scale_block_k(config.block_k, scale_block),
        GROUP_M=config.group_m,
        UPCAST=upcast, DOT_PRECISION="ieee" if upcast or a.dtype == torch.float32 else "tf32",
        SCALE=mode, SCALE_BN=bn, SCALE_BK=bk,
        num_warps=config.num_warps, num_stages=config.num_stages)


def check_fp8_scales(hidden: torch.Tensor, E: int, H: int, inter: int, w13_scale: object, w2_scale: object,
                     scale_block: object) -> Optional[tuple[int, int]]:
    """Check the FP8 weight scales of a fused MoE call (``fused_moe_triton``'s Args; the weights' own dtype is
    checked by the caller) and return scale_block as a tuple (None: per channel); ValueError naming the
    argument otherwise. Both scales or neither; scale_block only with them."""
    if (w13_scale is None) != (w2_scale is None):
        missing = "w2_scale" if w2_scale is None else "w13_scale"
        other = "w13_scale" if w2_scale is None else "w2_scale"
        raise ValueError(f"{missing}: required with {other} (FP8 weights take both scales or neither).")
    if w13_scale is None:
        if scale_block is not None:
            raise ValueError(f"scale_block: {scale_block!r} given without w13_scale / w2_scale.")
        return None
    block = None
    if scale_block is not None:
        if (not isinstance(scale_block, (tuple, list)) or len(scale_block) != 2
                or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in scale_block)):
            raise ValueError(f"scale_block: expected (BN, BK) positive ints, got {scale_block!r}.")
        block = (int(scale_block[0]), int(scale_block[1]))
        if block[1] % 16:
            raise ValueError(f"scale_block: BK ({block[1]}) must be a multiple of 16 (the kernels' K tile "
                             "divides it).")
    for name, scale, n, k in (("w13_scale", w13_scale, 2 * inter, H), ("w2_scale", w2_scale, H, inter)):
        shape = (E, n) if block is None else (E, cdiv(n, block[0]), cdiv(k, block[1]))
        check_tensor(name, scale, dtypes=(torch.float32,), shape=shape, device=hidden.device, contiguous=True)
    return block


def check_moe_inputs(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, *, w13_scale: Optional[torch.Tensor] = None,
                     w2_scale: Optional[torch.Tensor] = None, scale_block: Optional[tuple[int, int]] = None
                     ) -> tuple[int, int, int, int, int]:
    """Check a fused MoE call's tensors (``fused_moe_triton``'s Args) and return (T, H, E, I, K);
    ValueError naming the argument otherwise."""
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    T, H = hidden.shape
    fp8 = w13_scale is not None or w2_scale is not None
    w_dtype = FP8_DTYPE if fp8 else hidden.dtype
    check_tensor("w13", w13, ndim=3, dtypes=(w_dtype,), device=hidden.device, contiguous=True)
    E, two_i = w13.shape[0], w13.shape[1]
    if w13.shape[2] != H or two_i % 2 or two_i == 0 or E == 0:
        raise ValueError(f"w13: expected shape (E >= 1, 2 * I >= 2, {H}), got {tuple(w13.shape)}.")
    inter = two_i // 2
    check_tensor("w2", w2, dtypes=(w_dtype,), shape=(E, H, inter), device=hidden.device, contiguous=True)
    check_fp8_scales(hidden, E, H, inter, w13_scale, w2_scale, scale_block)
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64), device=hidden.device)
    top_k = topk_ids.shape[1]
    if topk_ids.shape[0] != T or not 1 <= top_k <= E:
        raise ValueError(f"topk_ids: expected shape ({T}, K) with 1 <= K <= {E}, got {tuple(topk_ids.shape)}.")
    check_tensor("topk_weights", topk_weights, dtypes=FLOAT_DTYPES, shape=(T, top_k), device=hidden.device)
    return T, H, E, inter, top_k


def dequantize_fp8_experts(w: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]] = None,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[E, N, K] dequantized expert weights in ``dtype``: W[e, n, k] = float(w[e, n, k]) * scale[e, n]
    (per channel, scale [E, N]) or * scale[e, n // BN, k // BK] (``block=(BN, BK)``, scale
    [E, cdiv(N, BN), cdiv(K, BK)]), computed in float32 and rounded to dtype once
    (``kernels.fp8_linear.dequantize_fp8_weight`` per expert). The twin's weights for FP8 experts."""
    return torch.stack([dequantize_fp8_weight(w[e], scale[e], block) for e in range(w.shape[0])]).to(dtype)


def fused_moe_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, config: Optional[FusedMoEConfig] = None, *,
                     w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                     scale_block: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """The routed experts' output, sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]).

    Args:
        hidden: [T, H] float16/bfloat16/float32, last dim contiguous (row stride free).
        w13: [E, 2 * I, H] each expert's gate rows then its up rows; hidden's dtype (float8_e4m3fn with
            scales) and device, contiguous.
        w2: [E, H, I] each expert's down projection; as w13.
        topk_weights: [T, K] routing weights, any float dtype (read as float32).
        topk_ids: [T, K] int32/int64 expert ids in [0, E) (not checked on the host: no sync).
        config: launch config; None: ``fused_moe_config(T, E, H, I, K, hidden.device)``. With block scales
            its block_k is capped to divide BK (``scale_block_k``).
        w13_scale, w2_scale: FP8 weights' dequantization scales (both or neither), float32, contiguous,
            hidden's device: per output channel [E, 2 * I] and [E, H], W[e, n, k] = float(w[e, n, k]) *
            scale[e, n]; or with ``scale_block`` per block [E, cdiv(2 * I, BN), cdiv(H, BK)] and
            [E, cdiv(H, BN), cdiv(I, BK)], W[e, n, k] = float(w[e, n, k]) * scale[e, n // BN, k // BK].
        scale_block: (BN, BK) positive ints, BK a multiple of 16 (e.g. (128, 128)); only with the scales.
            None: per-channel scales.

    Returns:
        A new [T, H] tensor in hidden's dtype (``engine.layers.moe.fused_moe_ref``'s result; with FP8
        weights, on ``dequantize_fp8_experts(w, scale, scale_block, hidden.dtype)``).

    No host synchronization and every buffer size is a function of the shapes (CUDA-graph safe).
    Buffers: the [P, I] intermediate (P <= T * K + E * (block_m - 1)) and the [T * K, H] weighted rows.
    """
    T, H, E, inter, top_k = check_moe_inputs(hidden, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale,
                                             w2_scale=w2_scale, scale_block=scale_block)
    scale_block = None if scale_block is None else tuple(scale_block)
    if config is None:
        config = fused_moe_config(T, E, H, inter, top_k, hidden.device)
    elif not isinstance(config, FusedMoEConfig):
        raise ValueError(f"config: expected a FusedMoEConfig, got {type(config).__name__}.")
    if T == 0 or H == 0:
        return torch.zeros_like(hidden, memory_format=torch.contiguous_format)
    num_pairs = T * top_k
    sorted_pair_ids, expert_of_block, num_valid = moe_align(topk_ids, E, config.block_m)
    topk_w = topk_weights.reshape(-1).contiguous()                                    # [T*K]
    intermediate = torch.empty(sorted_pair_ids.numel(), inter, dtype=hidden.dtype, device=hidden.device)  # [P, I]
    grouped_gemm(hidden, w13, intermediate, sorted_pair_ids, expert_of_block, num_valid, topk_w,
                 inter, H, num_pairs, top_k, True, True, config, num_experts=E, scatter=False,
                 mul_weight=False, w_scale=w13_scale, scale_block=scale_block)
    weighted = torch.empty(num_pairs, H, dtype=hidden.dtype, device=hidden.device)   # [T*K, H]
    grouped_gemm(intermediate, w2, weighted, sorted_pair_ids, expert_of_block, num_valid, topk_w,
                 H, inter, num_pairs, top_k, False, False, config, num_experts=E, scatter=True,
                 mul_weight=True, w_scale=w2_scale, scale_block=scale_block)
    return weighted.view(T, top_k, H).sum(dim=1, dtype=torch.float32).to(hidden.dtype)
