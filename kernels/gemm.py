"""Tiled GEMM for decode-sized batches: out = x @ weight.T (+ bias), M = 17..1024 token rows.

At decode batch 64-512 the projections of an 8B model sit near the ridge point of an H200
(M = 256 rows do ~256 FLOP per weight byte, the ridge is ~210): neither the weight read nor
the tensor cores alone set the time, and few output tiles (o_proj at M = 256 has 64 tiles of
128 x 128 for 132 SMs) leave SMs idle. cuBLAS picks one kernel per shape from its heuristics;
this kernel exists so ``benchmarks/gemm_sweep.py`` can measure whether a tile shape chosen per
(M, N, K) does better there. Measured on an H200 (benchmarks/RESULTS.md, "GEMM sweep"): no. The
best of 84 configs (pointer and TMA loads), picked per projection, is 2.7% / 0.5% / 0.1% faster
than cuBLAS summed over a decoder layer at M = 128 / 256 / 512 (both at ~600-770 TFLOPS), too
little for a second GEMM path, so the engine keeps cuBLAS and does not call this.

Grid: one program per [BLOCK_M, BLOCK_N] output tile, the M tiles of one column range adjacent
in launch order (program id = pid_n * num_m_tiles + pid_m), so the programs that read the same
weight columns run together and all but the first find them in L2. Each program loops over K in
BLOCK_K chunks: x tile [BLOCK_M, BLOCK_K] and weight tile [BLOCK_N, BLOCK_K] (pointer loads,
pipelined over ``num_stages``; or TMA descriptor loads with ``use_tma``), tl.dot into float32.

Numerics: float32 accumulation, bias added in float32, one rounding to x's dtype at the end (as
cuBLAS with a float32 compute type). The torch twin is ``gemm_ref``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

import triton
import triton.language as tl

from kernels.utils import FLOAT_DTYPES, cdiv, check_tensor, is_interpreted


@dataclass(frozen=True)
class GemmConfig:
    """Launch config of ``gemm``."""

    block_m: int = 64
    """Token rows per program (power of two, >= 16)."""
    block_n: int = 128
    """Output columns per program (power of two, >= 16)."""
    block_k: int = 64
    """Input columns per loop step (power of two, >= 16)."""
    num_warps: int = 4
    num_stages: int = 4
    """Software-pipeline depth of the K loop's loads."""
    use_tma: int = 0
    """1: load tiles through TMA tensor descriptors (Hopper+; needs 16-byte aligned row strides)."""


INTERPRETER_CONFIG = GemmConfig(16, 16, 16, 1, 1, 0)
"""Tiny tiles for CPU tensors under TRITON_INTERPRET=1 (tests)."""


def gemm_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """Default launch config for an [m, k] x [n, k].T product on ``device`` (the sweep's most
    frequent winner at M = 256 on an H200: 64 x 128 tiles, TMA off here for portability)."""
    if is_interpreted(device):
        return INTERPRETER_CONFIG
    return GemmConfig()


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr):
    """Semantics: y[m, n] = dtype(sum_k f32(x[m, k]) * f32(w[n, k]) (+ f32(b[n]))) for the
    program's [BLOCK_M, BLOCK_N] tile; rows >= M and columns >= N are neither read nor written."""
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m_tiles
    pid_n = pid // num_m_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + offs_k) < K
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:   # the interpreter's bf16 arithmetic is wrong: compute in fp32 there
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemm_tma_kernel(x_desc, w_desc, b_ptr, y_desc, M, N, K, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr):
    """Semantics as ``_gemm_kernel``; tiles move through TMA descriptors (out-of-range elements
    load as zero and are not stored)."""
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m_tiles
    pid_n = pid // num_m_tiles
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        a = x_desc.load([off_m, k0])
        w = w_desc.load([off_n, k0])
        acc = tl.dot(a, w.T, acc)
    if HAS_BIAS:
        offs_n = off_n + tl.arange(0, BLOCK_N)
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_desc.store([off_m, off_n], acc.to(y_desc.dtype))


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
         config: Optional[GemmConfig] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out = x @ weight.T (+ bias), float32 accumulation.

    Args:
        x: [M, K], float16/bfloat16/float32, last dim contiguous (row stride free).
        weight: [N, K] (nn.Linear layout), x's dtype, contiguous.
        bias: optional [N], x's dtype, contiguous; added in float32 before the final rounding.
        config: launch config; None: ``gemm_config(M, N, K, x.device)``.
        out: optional [M, N] destination in x's dtype, last dim contiguous; a new tensor if None.

    Returns:
        out: [M, N] in x's dtype.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    m, k = x.shape
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), shape=(None, k), device=x.device,
                 contiguous=True)
    n = weight.shape[0]
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,), shape=(n,), device=x.device, contiguous=True)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, ndim=2, dtypes=(x.dtype,), shape=(m, n), device=x.device,
                     last_dim_contiguous=True)
    cfg = config or gemm_config(m, n, k, x.device)
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(cfg, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"GemmConfig.{name}={v}: use a power of two >= 16.")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n)) if bias is not None else out.zero_()
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    b_arg = bias if bias is not None else weight
    if cfg.use_tma:
        _launch_tma(x, weight, b_arg, out, bias is not None, cfg, grid)
        return out
    upcast = is_interpreted(x.device) or x.dtype == torch.float32
    _gemm_kernel[grid](x, weight, b_arg, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                       HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                       BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, UPCAST=upcast,
                       PRECISION="ieee" if upcast else "tf32",
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def _launch_tma(x: torch.Tensor, weight: torch.Tensor, b_arg: torch.Tensor, out: torch.Tensor,
                has_bias: bool, cfg: GemmConfig, grid: tuple[int]) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    esize = x.element_size()
    for name, t in (("x", x), ("weight", weight), ("out", out)):
        if (t.stride(0) * esize) % 16 or t.data_ptr() % 16:
            raise ValueError(f"{name}: TMA needs 16-byte aligned rows (stride {t.stride(0)}); "
                             "use GemmConfig(use_tma=0).")
    x_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    y_desc = TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n])
    _gemm_tma_kernel[grid](x_desc, w_desc, b_arg, y_desc, x.shape[0], weight.shape[0], x.shape[1],
                           HAS_BIAS=has_bias, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                           BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps)


def gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Torch twin of ``gemm``: float32 product (+ bias), rounded once to x's dtype."""
    b = bias.float() if bias is not None else None
    return F.linear(x.float(), weight.float(), b).to(x.dtype)
