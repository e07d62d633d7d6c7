"""FP8 (e4m3) linear layers: W8A8 GEMM with activation quantization, torch twins.

Checkpoint formats served (the loader brings each to the canonical layouts below):

- compressed-tensors FP8 (llmcompressor ``FP8_DYNAMIC``): per-channel weight scales, activations
  quantized per token at run time (``PER_TOKEN``); or static per-tensor weight and input scales
  (``STATIC``; the loader expands the scalar weight scale to [N]).
- HF ``fp8`` block-wise (DeepSeek-V3, Qwen3-FP8): one ``weight_scale_inv`` per 128x128 weight block,
  activations quantized per token per 128-wide K group (``PER_TOKEN_GROUP``). Despite its name,
  ``weight_scale_inv`` is the dequantization multiplier: it is ``w_scale`` as is.
- ``--quantization fp8``: a 16-bit checkpoint quantized at load with
  ``quantize_weight_fp8_per_channel``, activations per token.

Canonical layouts:

- weight ``w``: torch.float8_e4m3fn [N, K] (out, in), contiguous, as in the checkpoint.
- weight scale ``w_scale``, float32, contiguous: per-channel [N], or with ``block_size=(BN, BK)``
  block-wise [cdiv(N, BN), cdiv(K, BK)] (the last row / column of blocks may be ragged).
- dequantized weight: W[n, k] = float(w[n, k]) * w_scale[n]  (per-channel)
                      W[n, k] = float(w[n, k]) * w_scale[n // BN, k // BK]  (block).
- activations ``x``: [M, K] float16 / bfloat16 / float32, last dim contiguous. Quantized
  (``quantize_activations_fp8``) to x_fp8 float8_e4m3fn [M, K] contiguous and float32 x_scale:
  ``PER_TOKEN`` [M, 1] (amax of the row / 448), ``PER_TOKEN_GROUP`` [M, cdiv(K, G)] (one scale per
  row per G-wide K group, G = BK for block weights), ``STATIC`` [1] (the given input_scale).
  X[m, k] = float(x_fp8[m, k]) * x_scale[m, k // G] (per-token: x_scale[m, 0]; static: x_scale[0]).

Kernels (Triton), each with its torch twin at the end of this module:

- ``quantize_activations_fp8``: one program per (row, K group); dynamic schemes take the group's
  amax in a first pass over the group, then write e4m3(clamp(x / scale, -448, 448)).
- ``fp8_linear``: out = (X @ W.T) (+ bias), a tl.dot GEMM on the fp8 operands with float32
  accumulation. Scales that are constant along K (per-token / static x, per-channel w) are applied
  once in the epilogue (acc * x_scale[m] * w_scale[n]); K-blocked scales (per-token-group x, block
  w) scale each K step's partial product, so the GEMM's block_k divides every K group.
  ``backend="scaled_mm"`` runs ``torch._scaled_mm`` (rowwise scales) instead, where it applies.

Numerics: e4m3(v) rounds to the nearest float8_e4m3fn value, ties to even (the values fed to it
are clamped to +-448, so nothing saturates to NaN). Scales and their reciprocals are computed
with IEEE division (``tl.math.div_rn``), and x is multiplied by the reciprocal, so the kernel's
fp8 activations and scales equal the twin's bit for bit on GPU. The GEMM differs from its twin
only in float32 summation order.

NOTE (interpreter): Triton's CPU interpreter converts float32 -> float8e4nv by truncating the
mantissa and rounding half up without carrying into the exponent (127.2 -> 64.0). Under the
interpreter (``SOFT_ROUND``) the quantize kernel first rounds to the e4m3 grid in float32
(``_round_to_e4m3``), after which the conversion is exact. It also stores -0.0 as +0.0.

Launch configs: ``Fp8QuantConfig`` / ``fp8_quant_config``, ``Fp8GemmConfig`` / ``fp8_gemm_config``:
frozen dataclasses and their default pickers; every wrapper takes an explicit ``config=`` (None: the
picker's). ``benchmarks/sweeps/fp8_sweep.py`` times them against torch._scaled_mm and bf16 F.linear.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

import triton
import triton.language as tl

from kernels.utils import FLOAT_DTYPES, cdiv, check_tensor, is_interpreted, next_power_of_2

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
MIN_AMAX = 1e-10
"""Floor of a dynamic scale's amax, so an all-zero row gets a finite scale (and x * (1 / scale) = 0)."""

PER_TOKEN, STATIC, PER_TOKEN_GROUP = "per_token", "static", "per_token_group"
ACTIVATION_SCHEMES = (PER_TOKEN, STATIC, PER_TOKEN_GROUP)
"""How activations are quantized: one dynamic scale per row, one given scale, or one dynamic scale
per row per K group."""
BACKENDS = ("triton", "scaled_mm", "auto")
"""``fp8_linear`` GEMM backends; "auto": torch._scaled_mm on CUDA where it applies and works, else Triton."""
DEFAULT_BLOCK_SIZE = (128, 128)
"""(BN, BK) of HF ``fp8`` block-wise checkpoints (``weight_block_size``)."""

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)
_X_TENSOR, _X_ROW, _X_GROUP = 0, 1, 2
"""Values of the GEMM's X_SCALE constexpr: x_scale [1], [M, 1] or [M, num_x_groups]."""


# ----------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------
@triton.jit
def _round_to_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still float32.

    Adds and subtracts 1.5 * 2^23 * ulp, ulp = the e4m3 spacing at v (2^(e - 3) for 2^e <= |v|,
    2^-9 in the subnormal range below 2^-6), so float32 addition does the rounding."""
    bits = v.to(tl.int32, bitcast=True)
    biased_exp = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
    magic = (((biased_exp + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (v + magic) - magic


@triton.jit
def _to_e4m3(v, SOFT_ROUND: tl.constexpr):
    """float32 v -> float8e4nv: clamped to +-448, rounded to nearest, ties to even."""
    v = tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX)
    if SOFT_ROUND:
        v = _round_to_e4m3(v)
    return v.to(tl.float8e4nv)


@triton.jit
def _quantize_fp8_kernel(x_ptr, q_ptr, s_ptr, static_s_ptr, K, group_size, num_groups, stride_x,
                         DYNAMIC: tl.constexpr, ONE_CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
                         SOFT_ROUND: tl.constexpr):
    """Semantics (float32 math; e4m3(.) rounds to nearest float8_e4m3fn, ties to even):

        for m in range(M):
            for g in range(num_groups):                    # cols = [g * group_size, min((g + 1) * group_size, K))
                v = float32(x[m, cols])
                scale = div(max(max(|v|), MIN_AMAX), 448) if DYNAMIC else static_s[0]
                if DYNAMIC: s[m, g] = scale                # s: [M, num_groups] contiguous
                q[m, cols] = e4m3(clamp(v * div(1, scale), -448, 448))

    Program (m, g) covers one group: with ONE_CHUNK (group_size <= BLOCK_K) in one load kept in
    registers, else in BLOCK_K chunks, twice when DYNAMIC (amax, then quantize).
    x rows at stride stride_x (last dim stride 1); q: [M, K] contiguous.
    """
    row = tl.program_id(0).to(tl.int64)
    k_start = tl.program_id(1) * group_size
    k_end = tl.minimum(k_start + group_size, K)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * K
    if ONE_CHUNK:
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        v = tl.load(x_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)                 # [BLOCK_K]
        if DYNAMIC:
            scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=0), _MIN_AMAX), _FP8_MAX)
            tl.store(s_ptr + row * num_groups + tl.program_id(1), scale)
        else:
            scale = tl.load(static_s_ptr)
        tl.store(q_row + offs_k, _to_e4m3(v * tl.math.div_rn(1.0, scale), SOFT_ROUND), mask=k_ok)
    else:
        if DYNAMIC:
            amax = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(k_start, k_end, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                v = tl.load(x_row + offs_k, mask=offs_k < k_end, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(v))
            scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), _MIN_AMAX), _FP8_MAX)
            tl.store(s_ptr + row * num_groups + tl.program_id(1), scale)
        else:
            scale = tl.load(static_s_ptr)
        inv_scale = tl.math.div_rn(1.0, scale)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_end
            v = tl.load(x_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            tl.store(q_row + offs_k, _to_e4m3(v * inv_scale, SOFT_ROUND), mask=k_ok)


@triton.jit
def _fp8_gemm_kernel(a_ptr, w_ptr, as_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, num_x_groups, num_w_kblocks,
                     X_SCALE: tl.constexpr, X_GROUP_K: tl.constexpr, W_BLOCK_N: tl.constexpr,
                     W_BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Semantics (float32 accumulation; dtype = out's dtype):

        for m in range(M):
            for n in range(N):
                acc = 0
                for k in range(K):
                    xs = a_s[0] if X_SCALE == TENSOR else a_s[m, 0] if X_SCALE == ROW else a_s[m, k // X_GROUP_K]
                    ws = w_s[n] if W_BLOCK_K == 0 else w_s[n // W_BLOCK_N, k // W_BLOCK_K]
                    acc += float(a[m, k]) * xs * float(w[n, k]) * ws
                out[m, n] = dtype(acc + (bias[n] if HAS_BIAS else 0))

    a: [M, K] fp8, w: [N, K] fp8, out: [M, N], all contiguous; a_s [M, num_x_groups] / w_s
    [cdiv(N, W_BLOCK_N), num_w_kblocks] contiguous float32. Program p covers a [BLOCK_M, BLOCK_N]
    output tile (GROUP_M row tiles side by side share their weight tiles in L2). K-blocked scales
    multiply each BLOCK_K step's tl.dot partial (BLOCK_K divides X_GROUP_K and W_BLOCK_K); the
    constant ones multiply the accumulator once at the end.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_id = pid // (GROUP_M * num_pid_n)
    first_pid_m = group_id * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % (GROUP_M * num_pid_n)) % group_rows
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * K                                    # [BM, 1]
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K                                    # [BN, 1]
    xs_rows = as_ptr + offs_m.to(tl.int64) * num_x_groups                                # [BM]
    ws_rows = ws_ptr + (offs_n // W_BLOCK_N) * num_w_kblocks                             # [BN]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)   # [BM, BK]
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)   # [BN, BK]
        if X_SCALE == 2 or W_BLOCK_K > 0:
            part = tl.dot(a, tl.trans(w))                                                # [BM, BN] f32
            if X_SCALE == 2:
                part *= tl.load(xs_rows + k0 // X_GROUP_K, mask=m_ok, other=0.0)[:, None]
            if W_BLOCK_K > 0:
                part *= tl.load(ws_rows + k0 // W_BLOCK_K, mask=n_ok, other=0.0)[None, :]
            acc += part
        else:
            # Each step's product joins the float32 accumulator apart: Hopper's FP8 MMA accumulates in
            # reduced precision, so a chain over all of K would lose bits as K grows.
            acc += tl.dot(a, tl.trans(w))
    if X_SCALE == 0:
        acc *= tl.load(as_ptr)
    elif X_SCALE == 1:
        acc *= tl.load(xs_rows, mask=m_ok, other=0.0)[:, None]
    if W_BLOCK_K == 0:
        acc *= tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# ----------------------------------------------------------------------------------------
# Launch configs
# ----------------------------------------------------------------------------------------
def _check_pow2(owner: str, name: str, value: object, min_value: int, max_value: int) -> None:
    if (isinstance(value, bool) or not isinstance(value, int) or not min_value <= value <= max_value
            or value & (value - 1)):
        raise ValueError(f"{owner}.{name}: {value!r} must be a power of two in [{min_value}, {max_value}].")


def _check_stages(owner: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.num_stages: {value!r} must be an int >= 1.")


@dataclass(frozen=True)
class Fp8QuantConfig:
    """Launch parameters of the activation quantization kernel."""

    block_k: int = 1024
    """Elements per chunk: a group that fits is loaded once and kept in registers, a wider one is
    looped over in chunks twice (amax, quantize); the static scheme's group width (its scale needs
    no pass over a row). Power of two in [16, 8192]."""
    num_warps: int = 4
    """Warps per program (power of two in [1, 16])."""

    def __post_init__(self) -> None:
        _check_pow2("Fp8QuantConfig", "block_k", self.block_k, 16, 8192)
        _check_pow2("Fp8QuantConfig", "num_warps", self.num_warps, 1, 16)


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Launch parameters of the W8A8 GEMM."""

    block_m: int = 64
    """Token rows per output tile (power of two in [16, 256])."""
    block_n: int = 128
    """Output columns per output tile (power of two in [16, 256])."""
    block_k: int = 128
    """K per inner step (power of two in [16, 512]); must divide every K group of the call's scales.
    On GPU fp8 tl.dot wants >= 32."""
    group_m: int = 8
    """Row tiles launched side by side over the same weight tiles (L2 reuse); >= 1."""
    num_warps: int = 4
    """Warps per program (power of two in [1, 16])."""
    num_stages: int = 3
    """Software-pipelining depth of the K loop (>= 1)."""

    def __post_init__(self) -> None:
        _check_pow2("Fp8GemmConfig", "block_m", self.block_m, 16, 256)
        _check_pow2("Fp8GemmConfig", "block_n", self.block_n, 16, 256)
        _check_pow2("Fp8GemmConfig", "block_k", self.block_k, 16, 512)
        _check_pow2("Fp8GemmConfig", "num_warps", self.num_warps, 1, 16)
        _check_stages("Fp8GemmConfig", self.num_stages)
        if isinstance(self.group_m, bool) or not isinstance(self.group_m, int) or self.group_m < 1:
            raise ValueError(f"Fp8GemmConfig.group_m: {self.group_m!r} must be an int >= 1.")


def _pow2_divisor(k_group: Optional[int], cap: int) -> int:
    """Largest power of two <= cap dividing k_group (cap when k_group is None)."""
    if k_group is None:
        return cap
    return min(cap, k_group & -k_group)


def fp8_quant_config(M: int, K: int, group_size: Optional[int] = None,
                     device: Optional[torch.device] = None) -> Fp8QuantConfig:
    """Default config to quantize [M, K] activations in groups of ``group_size`` (None: whole rows).

    A group up to 8192 wide is one chunk held in registers (one read of x), with 256 elements per
    warp up to 16 warps; the interpreter (CPU device) gets 128-wide chunks (its cost is per
    program and per chunk, not per element)."""
    if device is not None and is_interpreted(device):
        return Fp8QuantConfig(block_k=128, num_warps=1)
    width = K if group_size is None else min(K, group_size)
    block_k = min(8192, max(16, next_power_of_2(width)))
    return Fp8QuantConfig(block_k=block_k, num_warps=min(16, max(1, block_k // 256)))


def fp8_gemm_config(M: int, N: int, K: int, device: Optional[torch.device] = None,
                    k_group: Optional[int] = None) -> Fp8GemmConfig:
    """Default config for an [M, K] x [N, K]^T fp8 GEMM whose scales change every ``k_group`` K
    elements (None: constant along K). block_k divides k_group.

    NOTE: starting points from the usual Hopper fp8 tiles (128-wide K steps, the tile grows with M);
    ``benchmarks/sweeps/fp8_sweep.py`` ranks them on the H200."""
    if device is not None and is_interpreted(device):
        return Fp8GemmConfig(16, 64, _pow2_divisor(k_group, 64), 1, 4, 1)
    block_k = _pow2_divisor(k_group, 128)
    if M <= 16:
        return Fp8GemmConfig(16, 64, block_k, 1, 4, 4)
    if M <= 64:
        return Fp8GemmConfig(64, 64, block_k, 8, 4, 4)
    if M <= 256:
        return Fp8GemmConfig(64, 128, block_k, 8, 4, 3)
    return Fp8GemmConfig(128, 128, block_k, 8, 8, 3)


# ----------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------
def _check_rows(name: str, x: object) -> tuple[int, int]:
    check_tensor(name, x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if x.shape[1] < 1:
        raise ValueError(f"{name}: shape {tuple(x.shape)} must have K >= 1 columns.")
    return x.shape[0], x.shape[1]


def _check_block_size(block_size: object) -> Optional[tuple[int, int]]:
    if block_size is None:
        return None
    if (not isinstance(block_size, (tuple, list)) or len(block_size) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block_size)):
        raise ValueError(f"block_size: expected (BN, BK) positive ints, got {block_size!r}.")
    return int(block_size[0]), int(block_size[1])


def _check_weight(x: torch.Tensor, w: object, w_scale: object, block_size: Optional[tuple[int, int]],
                  bias: object) -> int:
    """Check w [N, K] fp8, its scales (per-channel [N] or block [cdiv(N, BN), cdiv(K, BK)]) and bias [N];
    returns N."""
    K = x.shape[1]
    check_tensor("w", w, ndim=2, dtypes=(FP8_DTYPE,), device=x.device, contiguous=True)
    check_tensor("w", w, shape=(None, K))
    N = w.shape[0]
    if N < 1:
        raise ValueError(f"w: shape {tuple(w.shape)} must have N >= 1 rows.")
    if block_size is None:
        check_tensor("w_scale", w_scale, dtypes=(torch.float32,), shape=(N,), device=x.device, contiguous=True)
    else:
        bn, bk = block_size
        check_tensor("w_scale", w_scale, dtypes=(torch.float32,), shape=(cdiv(N, bn), cdiv(K, bk)),
                     device=x.device, contiguous=True)
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, shape=(N,), device=x.device, contiguous=True)
    return N


def _check_block_k(owner: str, block_k: int, k_groups: dict[str, Optional[int]]) -> None:
    for name, group in k_groups.items():
        if group is not None and group % block_k:
            raise ValueError(f"{owner}.block_k: {block_k} must divide {name} ({group}).")


def _check_scheme(scheme: object, input_scale: object, device: torch.device) -> None:
    if scheme not in ACTIVATION_SCHEMES:
        raise ValueError(f"activation_scheme: {scheme!r} must be one of {ACTIVATION_SCHEMES}.")
    if scheme == STATIC:
        check_tensor("input_scale", input_scale, dtypes=(torch.float32,), device=device)
        if input_scale.numel() != 1:
            raise ValueError(f"input_scale: expected one value, got shape {tuple(input_scale.shape)}.")
    elif input_scale is not None:
        raise ValueError(f"input_scale: given with the dynamic scheme {scheme!r}; only {STATIC!r} takes one.")


# ----------------------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------------------
def quantize_activations_fp8(x: torch.Tensor, scheme: str, input_scale: Optional[torch.Tensor] = None,
                             group_size: int = 128, *, config: Optional[Fp8QuantConfig] = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations to float8_e4m3fn.

    Args:
        x: [M, K] float16/bfloat16/float32, last dim contiguous (row stride free).
        scheme: ``PER_TOKEN`` (scale = max(amax(row), MIN_AMAX) / 448), ``PER_TOKEN_GROUP`` (the same
            per ``group_size``-wide K group) or ``STATIC`` (the given ``input_scale``).
        input_scale: STATIC only: one float32 value on x's device (any shape of one element).
        group_size: K group width of ``PER_TOKEN_GROUP`` (ignored otherwise), >= 1.
        config: launch config; None: ``fp8_quant_config``.

    Returns:
        (x_fp8, x_scale): x_fp8 [M, K] float8_e4m3fn contiguous, e4m3(clamp(x / scale, -448, 448))
        with x / scale computed as float32(x) * (1 / scale); x_scale float32: [M, 1] (PER_TOKEN),
        [M, cdiv(K, group_size)] (PER_TOKEN_GROUP), input_scale as [1] (STATIC).
    """
    M, K = _check_rows("x", x)
    _check_scheme(scheme, input_scale, x.device)
    if scheme == PER_TOKEN_GROUP and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                      or group_size < 1):
        raise ValueError(f"group_size: expected an int >= 1, got {group_size!r}.")
    if config is not None and not isinstance(config, Fp8QuantConfig):
        raise ValueError(f"config: expected an Fp8QuantConfig, got {type(config).__name__}.")
    dynamic = scheme != STATIC
    if config is None:
        config = fp8_quant_config(M, K, group_size if scheme == PER_TOKEN_GROUP else None, x.device)
    width = K if scheme == PER_TOKEN else group_size if scheme == PER_TOKEN_GROUP else config.block_k
    num_groups = cdiv(K, width)
    x_fp8 = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)                                 # [M, K]
    if dynamic:
        x_scale = torch.empty(M, num_groups, dtype=torch.float32, device=x.device)             # [M, G]
    else:
        x_scale = input_scale.reshape(1)                                                        # [1]
    if M == 0:
        return x_fp8, x_scale
    block_k = min(config.block_k, max(16, next_power_of_2(width)))
    _quantize_fp8_kernel[(M, num_groups)](
        x, x_fp8, x_scale, x_scale, K, width, num_groups, x.stride(0),
        DYNAMIC=dynamic, ONE_CHUNK=width <= block_k, BLOCK_K=block_k, SOFT_ROUND=is_interpreted(x.device),
        num_warps=config.num_warps)
    return x_fp8, x_scale


@functools.lru_cache(maxsize=None)
def scaled_mm_works(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs rowwise-scaled fp8 with a bf16 bias and bf16 output on
    ``device``: one tiny call, remembered per device (the torch build and the GPU decide, not the shapes).

    NOTE: the probe synchronizes, so it cannot run inside CUDA graph capture: there it raises
    RuntimeError (not remembered). Call it once at load, before capture, as the first eager
    ``fp8_linear`` call with backend "auto" does.
    """
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("scaled_mm_works: probe torch._scaled_mm before CUDA graph capture "
                           "(call scaled_mm_works(device) at load).")
    try:
        a = torch.ones(16, 32, device=device).to(FP8_DTYPE)                                     # [16, 32]
        b = torch.ones(16, 32, device=device).to(FP8_DTYPE)                                     # [16, 32]
        out = torch._scaled_mm(a, b.t(), scale_a=torch.ones(16, 1, device=device),
                               scale_b=torch.ones(1, 16, device=device),
                               bias=torch.ones(16, device=device, dtype=torch.bfloat16),
                               out_dtype=torch.bfloat16)                                         # [16, 16]
        return bool((out.float() == 33.0).all())
    except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError):
        return False


def _scaled_mm_applies(M: int, N: int, K: int, scheme: str, block_size: Optional[tuple[int, int]],
                       out_dtype: torch.dtype, bias: Optional[torch.Tensor]) -> Optional[str]:
    """None when ``torch._scaled_mm`` takes this call, else why not."""
    if block_size is not None or scheme == PER_TOKEN_GROUP:
        return "block / per-token-group scales (rowwise _scaled_mm takes one scale per row and column)"
    if out_dtype != torch.bfloat16:
        return f"out_dtype {out_dtype} (rowwise _scaled_mm writes bfloat16)"
    if bias is not None and bias.dtype != torch.bfloat16:
        return f"bias dtype {bias.dtype} (rowwise _scaled_mm takes a bfloat16 bias)"
    if N % 16 or K % 16:
        return f"N={N}, K={K} (_scaled_mm needs both multiples of 16)"
    return None


def _use_scaled_mm(backend: str, device: torch.device, why_not: Optional[str]) -> bool:
    """Resolve ``fp8_linear``'s backend: True for torch._scaled_mm, False for the Triton GEMM."""
    if backend == "triton":
        return False
    if backend == "scaled_mm":
        if why_not is not None:
            raise ValueError(f"backend 'scaled_mm' does not apply: {why_not}.")
        if not scaled_mm_works(device):
            raise RuntimeError(f"backend 'scaled_mm': torch._scaled_mm with rowwise scales fails on {device} "
                               f"(torch {torch.__version__}).")
        return True
    return device.type == "cuda" and why_not is None and scaled_mm_works(device)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *, activation_scheme: str,
               input_scale: Optional[torch.Tensor] = None, block_size: Optional[tuple[int, int]] = None,
               bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
               group_size: Optional[int] = None, backend: str = "auto",
               config: Optional[Fp8GemmConfig] = None,
               quant_config: Optional[Fp8QuantConfig] = None) -> torch.Tensor:
    """out = X @ W.T (+ bias), W8A8: x quantized to fp8 (``quantize_activations_fp8``), then an fp8 GEMM.

    Args:
        x: [M, K] float16/bfloat16/float32, last dim contiguous.
        w: [N, K] float8_e4m3fn, contiguous.
        w_scale: float32 contiguous, [N] per-channel, or [cdiv(N, BN), cdiv(K, BK)] with ``block_size``.
        activation_scheme: ``PER_TOKEN``, ``STATIC`` or ``PER_TOKEN_GROUP``.
        input_scale: STATIC only: one float32 value on x's device.
        block_size: (BN, BK) of block weight scales; None: per-channel.
        bias: optional [N] float16/bfloat16/float32, added in float32 before the final rounding.
        out_dtype: float16/bfloat16/float32; None: x's dtype.
        group_size: K group of ``PER_TOKEN_GROUP``; None: BK with block_size, else 128.
        backend: "triton"; "scaled_mm" (torch._scaled_mm, rowwise scales: per-channel w with
            PER_TOKEN / STATIC x, bfloat16 out and bias, N and K multiples of 16; ValueError where it
            does not apply, RuntimeError where this torch / device cannot run it); "auto": scaled_mm
            on CUDA where it applies and works, else triton.
        config: Triton GEMM launch config; None: ``fp8_gemm_config``.
        quant_config: activation quantization launch config; None: ``fp8_quant_config``.

    Returns:
        out: a new [M, N] tensor in out_dtype.
    """
    M, K = _check_rows("x", x)
    block_size = _check_block_size(block_size)
    N = _check_weight(x, w, w_scale, block_size, bias)
    _check_scheme(activation_scheme, input_scale, x.device)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype: {out_dtype} not supported; expected one of {FLOAT_DTYPES}.")
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} must be one of {BACKENDS}.")
    if config is not None and not isinstance(config, Fp8GemmConfig):
        raise ValueError(f"config: expected an Fp8GemmConfig, got {type(config).__name__}.")
    if group_size is None:
        group_size = block_size[1] if block_size is not None else DEFAULT_BLOCK_SIZE[1]
    x_group_k = group_size if activation_scheme == PER_TOKEN_GROUP else None
    w_block_k = block_size[1] if block_size is not None else None

    why_not = _scaled_mm_applies(M, N, K, activation_scheme, block_size, out_dtype, bias)
    use_scaled_mm = _use_scaled_mm(backend, x.device, why_not)
    if not use_scaled_mm:
        if config is None:
            k_groups = [g for g in (x_group_k, w_block_k) if g is not None]
            config = fp8_gemm_config(M, N, K, x.device, math.gcd(*k_groups) if k_groups else None)
        _check_block_k("Fp8GemmConfig", config.block_k, {"group_size": x_group_k, "block_size[1]": w_block_k})
    if M == 0:
        return torch.empty(0, N, dtype=out_dtype, device=x.device)                              # [0, N]
    x_fp8, x_scale = quantize_activations_fp8(x, activation_scheme, input_scale, group_size, config=quant_config)
    if use_scaled_mm:
        scale_a = x_scale.expand(M, 1).contiguous() if activation_scheme == STATIC else x_scale   # [M, 1]
        return torch._scaled_mm(x_fp8, w.t(), scale_a=scale_a, scale_b=w_scale.view(1, N), bias=bias,
                                out_dtype=out_dtype)
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)                                   # [M, N]
    grid = (cdiv(M, config.block_m) * cdiv(N, config.block_n),)
    x_mode = _X_TENSOR if activation_scheme == STATIC else _X_ROW if activation_scheme == PER_TOKEN else _X_GROUP
    _fp8_gemm_kernel[grid](
        x_fp8, w, x_scale, w_scale, bias if bias is not None else w_scale, out, M, N, K,
        x_scale.shape[-1], cdiv(K, w_block_k) if w_block_k else 1,
        X_SCALE=x_mode, X_GROUP_K=x_group_k or 1, W_BLOCK_N=block_size[0] if block_size else 1,
        W_BLOCK_K=w_block_k or 0, HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages)
    return out


# ----------------------------------------------------------------------------------------
# Weight quantization and torch twins (the test oracle)
# ----------------------------------------------------------------------------------------
def quantize_weight_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric fp8 quantization (llmcompressor ``FP8_DYNAMIC``'s weights).

    Args:
        w: [N, K] float weight (any float dtype and device).

    Returns:
        (w_fp8 [N, K] float8_e4m3fn contiguous, scale [N] float32) with scale = max(amax(row) / 448,
        float32 eps) and w_fp8 = e4m3(clamp(w / scale, -448, 448)).
    """
    check_tensor("w", w, ndim=2, dtypes=FLOAT_DTYPES)
    wf = w.float()                                                                               # [N, K]
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).eps)           # [N]
    w_fp8 = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).contiguous()            # [N, K]
    return w_fp8, scale


def dequantize_fp8_weight(w: torch.Tensor, scale: torch.Tensor,
                          block_size: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """W [N, K] float32 = float(w) * scale[n] (per-channel) or * scale[n // BN, k // BK] (block)."""
    N, K = w.shape
    if block_size is None:
        return w.float() * scale.float()[:, None]
    bn, bk = block_size
    full = scale.float().repeat_interleave(bn, dim=0)[:N].repeat_interleave(bk, dim=1)[:, :K]    # [N, K]
    return w.float() * full


def quantize_activations_fp8_ref(x: torch.Tensor, scheme: str, input_scale: Optional[torch.Tensor] = None,
                                 group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of ``quantize_activations_fp8`` (same outputs, same layouts)."""
    M, K = x.shape
    if scheme == STATIC:
        scale = input_scale.reshape(1).float()                                                   # [1]
        q = (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX)                                 # [M, K]
        return q.to(FP8_DTYPE), scale
    width = K if scheme == PER_TOKEN else group_size
    G = cdiv(K, width)
    xg = F.pad(x.float(), (0, G * width - K)).view(M, G, width)                                  # [M, G, width]
    # A tensor divisor: CUDA divides by a host scalar through its reciprocal, not by IEEE division.
    fp8_max = torch.tensor(FP8_MAX, dtype=torch.float32, device=x.device)
    scale = xg.abs().amax(dim=2).clamp(min=MIN_AMAX) / fp8_max                                   # [M, G]
    q = (xg * (1.0 / scale)[:, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return q.view(M, G * width)[:, :K].to(FP8_DTYPE), scale


def dequantize_activations_fp8(x_fp8: torch.Tensor, x_scale: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """X [M, K] float32 = float(x_fp8) * x_scale (layouts of ``quantize_activations_fp8``)."""
    K = x_fp8.shape[1]
    if x_scale.dim() == 2 and x_scale.shape[1] > 1:
        return x_fp8.float() * x_scale.repeat_interleave(group_size, dim=1)[:, :K]
    return x_fp8.float() * x_scale.reshape(-1, 1)


def fp8_linear_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, *, activation_scheme: str,
                   input_scale: Optional[torch.Tensor] = None, block_size: Optional[tuple[int, int]] = None,
                   bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                   group_size: Optional[int] = None) -> torch.Tensor:
    """Twin of ``fp8_linear``: ``quantize_activations_fp8_ref``, then a float32 ``F.linear`` of the
    dequantized operands, rounded once to out_dtype."""
    if group_size is None:
        group_size = block_size[1] if block_size is not None else DEFAULT_BLOCK_SIZE[1]
    x_fp8, x_scale = quantize_activations_fp8_ref(x, activation_scheme, input_scale, group_size)
    xd = dequantize_activations_fp8(x_fp8, x_scale, group_size)                                  # [M, K]
    out = F.linear(xd, dequantize_fp8_weight(w, w_scale, block_size), bias.float() if bias is not None else None)
    return out.to(x.dtype if out_dtype is None else out_dtype)

