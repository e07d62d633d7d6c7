"""Decode GEMV (plain, SiLU-and-mul prologue, add + RMSNorm prologue): the Triton kernel against its
torch twins (``kernels.gemv.*_ref``). CPU tensors run through the interpreter with small explicit tiles
(N and K tails, both inner-product formulations); the CUDA tests run Llama-3-8B sizes."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv import (GemvConfig, add_rms_norm_gemv, add_rms_norm_gemv_ref, gemv, gemv_config, gemv_ref,
                          silu_mul_gemv, silu_mul_gemv_ref)
from tests.kernels.pairwise import pairwise

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PROLOGUES = ["plain", "silu_mul", "add_rmsnorm", "rmsnorm"]     # rmsnorm: add_rms_norm_gemv with residual None
EPS = 1e-5


def _tol(dtype):
    # As test_kernel_layer_ops: roundings may land one ulp apart (the interpreter truncates fp32 -> bf16).
    return dict(float32=(1e-5, 1e-5), float16=(2e-3, 2e-3), bfloat16=(2e-2, 2e-2))[str(dtype).split(".")[1]]


def _rows(m: int, width: int, dtype, g, strided: bool, scale: float = 1.0) -> torch.Tensor:
    """[m, width] random rows; with ``strided`` a column slice of a wider buffer (row stride > width)."""
    buf = (scale * torch.randn(m, width + (24 if strided else 0), generator=g)).to(dtype).to(DEVICE)
    return buf[:, 8:8 + width] if strided else buf


def _case(prologue: str, m: int, n: int, k: int, dtype, bias: bool, strided: bool, seed: int = 0):
    """Inputs of one call: (args for the kernel wrapper / twin, without config)."""
    g = torch.Generator().manual_seed(seed + 1000 * m + n + k)
    weight = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    if prologue == "plain":
        return (_rows(m, k, dtype, g, strided), weight, b)
    if prologue == "silu_mul":
        return (_rows(m, 2 * k, dtype, g, strided), weight, b)
    x = _rows(m, k, dtype, g, strided)
    residual = _rows(m, k, dtype, g, strided) if prologue == "add_rmsnorm" else None
    norm_weight = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    return (x, residual, norm_weight, EPS, weight, b)


def _run(prologue: str, args, config):
    """(kernel out, kernel residual_out or None, twin out, twin residual_out or None)."""
    if prologue == "plain":
        return gemv(*args, config=config), None, gemv_ref(*args), None
    if prologue == "silu_mul":
        return silu_mul_gemv(*args, config=config), None, silu_mul_gemv_ref(*args), None
    out, res = add_rms_norm_gemv(*args, config=config)
    ref_out, ref_res = add_rms_norm_gemv_ref(*args)
    return out, res, ref_out, ref_res


def _check(prologue: str, args, config, dtype):
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    before = [a.clone() for a in inputs]
    out, res, ref_out, ref_res = _run(prologue, args, config)
    rtol, atol = _tol(dtype)
    assert out.dtype == dtype and out.shape == ref_out.shape and out.is_contiguous()
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=rtol, atol=atol)
    for a, b in zip(inputs, before):                      # x / residual / weights untouched
        assert torch.equal(a, b)
    if prologue == "rmsnorm":
        assert res is args[0]                             # x itself, no copy
    elif prologue == "add_rmsnorm":
        x, residual = args[0], args[1]
        assert res.data_ptr() not in (x.data_ptr(), residual.data_ptr()) and res.is_contiguous()
        if dtype == torch.bfloat16 and DEVICE.type == "cpu":
            # One ulp apart at most: the interpreter truncates where torch rounds to nearest.
            torch.testing.assert_close(res.float(), ref_res.float(), rtol=2 ** -7, atol=1e-6)
        else:
            assert torch.equal(res, ref_res)


# N, K: tails of both (40 = 2.5 x 16, 200 = 3 x 64 + 8); bias and strided rows on one of the two.
SHAPES = [(40, 200, True, True), (96, 64, False, False)]


@pytest.mark.parametrize("prologue,dtype,m,use_dot,shape",
                         pairwise(PROLOGUES, DTYPES, [1, 3, 8, 16], [0, 1], range(len(SHAPES))))
def test_matches_twin(prologue, dtype, m, use_dot, shape):
    """Every pair of prologue, dtype, row count, formulation and shape."""
    n, k, bias, strided = SHAPES[shape]
    config = GemvConfig(block_n=16 if n == 40 else 32, block_k=64 if k == 200 else 32, num_warps=4,
                        num_stages=1, use_dot=use_dot)
    _check(prologue, _case(prologue, m, n, k, dtype, bias, strided), config, dtype)


@pytest.mark.parametrize("prologue,m,use_dot", pairwise(["add_rmsnorm", "rmsnorm"], [9, 16], [0, 1]))
def test_rmsnorm_stats_chunks(prologue, m, use_dot):
    """K = 520 over 256-wide statistics chunks (4096 // BLOCK_M_rows): three passes with a tail."""
    config = GemvConfig(block_n=16, block_k=128, num_warps=4, num_stages=1, use_dot=use_dot)
    _check(prologue, _case(prologue, m, 24, 520, torch.bfloat16, True, True), config, torch.bfloat16)


@pytest.mark.parametrize("prologue", PROLOGUES)
def test_default_config(prologue):
    """config=None: the device's default tiles (interpreter: one tile over N here, K tail of 8)."""
    _check(prologue, _case(prologue, 5, 24, 136, torch.float32, True, False), None, torch.float32)


@pytest.mark.parametrize("prologue", PROLOGUES)
def test_zero_rows(prologue):
    args = _case(prologue, 0, 24, 32, torch.float32, False, False)
    out, res, _, _ = _run(prologue, args, None)
    assert out.shape == (0, 24)
    if res is not None:
        assert res.shape == (0, 32)


def test_gemv_config_override(monkeypatch):
    """The override applies over the default config; the kernel module reads no configuration of its
    own (the engine's ``KernelPolicy.gemv`` is passed in by ``Linear.forward_base`` and
    ``engine.layers.fused``)."""
    monkeypatch.setenv("CHORUS_KERNEL_POLICY", "gemv.block_n=128")      # not read here
    base = gemv_config(4, 6144, 4096)
    assert base == GemvConfig(32, 512, 4, 3, 1)
    override = (("block_k", 128), ("block_n", 64), ("num_stages", 2), ("use_dot", 1))
    cfg = gemv_config(4, 6144, 4096, override=override)
    assert (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.use_dot) == (64, 128, base.num_warps, 2, 1)
    with pytest.raises(ValueError, match="unknown field.*tile_n"):
        gemv_config(4, 6144, 4096, override=(("tile_n", 32),))
    with pytest.raises(ValueError, match="block_n"):
        gemv_config(4, 6144, 4096, override=(("block_n", 24),))        # rejected by GemvConfig


def test_wrapper_override_reaches_the_launch():
    """``override=`` without ``config=`` picks the launch tiles (the interpreter's defaults here are
    elementwise; use_dot=1 with block_n 16 must still match the twin)."""
    args = _case("plain", 3, 40, 48, torch.float32, True, False)
    out = gemv(*args, override=(("block_n", 16), ("block_k", 16), ("use_dot", 1)))
    torch.testing.assert_close(out, gemv_ref(*args), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown field"):
        gemv(*args, override=(("tile_n", 16),))


def test_config_checks():
    with pytest.raises(ValueError, match="block_n"):
        GemvConfig(block_n=24)
    with pytest.raises(ValueError, match="block_n"):
        GemvConfig(block_n=8, use_dot=1)                                 # tl.dot needs >= 16
    with pytest.raises(ValueError, match="block_k"):
        GemvConfig(block_k=8)
    with pytest.raises(ValueError, match="num_warps"):
        GemvConfig(num_warps=3)
    with pytest.raises(ValueError, match="num_stages"):
        GemvConfig(num_stages=0)
    with pytest.raises(ValueError, match="use_dot"):
        GemvConfig(use_dot=2)
    with pytest.raises(ValueError, match="reduce_once"):
        GemvConfig(reduce_once=2)
    assert GemvConfig(use_dot=0).block_m(3) == 4 and GemvConfig(use_dot=1).block_m(3) == 16
    assert GemvConfig(use_dot=0).block_m(1) == 1


def test_checks_reject_bad_inputs():
    f32 = dict(device=DEVICE)
    x, w = torch.randn(2, 32, **f32), torch.randn(24, 32, **f32)
    with pytest.raises(ValueError, match="at most 16"):
        gemv(torch.randn(17, 32, **f32), w)
    with pytest.raises(ValueError, match="weight: expected shape"):
        gemv(x, torch.randn(24, 40, **f32))                                  # K mismatch
    with pytest.raises(ValueError, match="weight: must be contiguous"):
        gemv(x, torch.randn(32, 24, **f32).t())
    with pytest.raises(ValueError, match="weight: dtype"):
        gemv(x, w.half())
    with pytest.raises(ValueError, match="x: last dim must have stride 1"):
        gemv(torch.randn(32, 2, **f32).t(), w)
    with pytest.raises(ValueError, match="bias"):
        gemv(x, w, torch.randn(23, **f32))
    with pytest.raises(ValueError, match="bias: dtype"):
        gemv(x, w, torch.randn(24, **f32).half())
    with pytest.raises(ValueError, match="config"):
        gemv(x, w, config=dict(block_n=16))
    with pytest.raises(ValueError, match="even"):
        silu_mul_gemv(torch.randn(2, 63, **f32), w)
    with pytest.raises(ValueError, match="weight: expected shape"):
        silu_mul_gemv(torch.randn(2, 32, **f32), w)                           # K = 16, weight has 32
    with pytest.raises(ValueError, match="at most 16"):
        silu_mul_gemv(torch.randn(20, 64, **f32), w)
    nw = torch.ones(32, **f32)
    with pytest.raises(ValueError, match="residual: expected shape"):
        add_rms_norm_gemv(x, torch.randn(3, 32, **f32), nw, EPS, w)
    with pytest.raises(ValueError, match="residual: dtype"):
        add_rms_norm_gemv(x, x.half(), nw, EPS, w)
    with pytest.raises(ValueError, match="norm_weight"):
        add_rms_norm_gemv(x, None, torch.ones(31, **f32), EPS, w)
    with pytest.raises(ValueError, match="eps"):
        add_rms_norm_gemv(x, None, nw, -1.0, w)
    with pytest.raises(ValueError, match="weight: dtype"):
        add_rms_norm_gemv(x, None, nw, EPS, w.to(torch.bfloat16))


# ----------------------------------------------------------------------------------------
# CUDA: Llama-3-8B decode sizes
# ----------------------------------------------------------------------------------------
CUDA_CASES = [("plain", 6144, 4096), ("plain", 4096, 4096), ("plain", 28672, 4096), ("plain", 4096, 14336),
              ("silu_mul", 4096, 14336), ("add_rmsnorm", 6144, 4096), ("add_rmsnorm", 28672, 4096),
              ("rmsnorm", 6144, 4096)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", [None, GemvConfig(32, 256, 4, 3, 0), GemvConfig(32, 256, 4, 3, 1)],
                         ids=["default", "elementwise", "dot"])
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("prologue,n,k", CUDA_CASES)
def test_gpu_real_sizes(prologue, n, k, m, config):
    _check(prologue, _case(prologue, m, n, k, torch.bfloat16, bias=(n == 6144), strided=(m == 4)), config,
           torch.bfloat16)


# ----------------------------------------------------------------------------------------
# FP8 (e4m3) weights: per-channel and block scales, converted in registers (W8A16)
# ----------------------------------------------------------------------------------------
def _fp8_case(prologue: str, m: int, n: int, k: int, dtype, scale_block, seed: int = 0):
    """(args, fp8 kwargs): ``_case``'s inputs with the weight as e4m3 and its float32 scales."""
    from kernels.fp8_linear import quantize_weight_fp8_per_channel

    args = list(_case(prologue, m, n, k, dtype, bias=True, strided=m % 2 == 1, seed=seed))
    w = args[-2].float().cpu()                                                          # [N, K]
    if scale_block is None:
        wq, scale = quantize_weight_fp8_per_channel(w)                                  # [N, K], [N]
    else:
        g = torch.Generator().manual_seed(seed + 7)
        bn, bk = scale_block
        scale = (0.5 + torch.rand(-(-n // bn), -(-k // bk), generator=g)) / 448         # [cdiv(N, bn), cdiv(K, bk)]
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        wq = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    args[-2] = wq.to(DEVICE)
    return tuple(args), dict(weight_scale=scale.to(DEVICE), scale_block=scale_block)


def _run_fp8(prologue: str, args, fp8, config, override=(), fp8_math: int = 0):
    """(kernel out, kernel residual_out or None, twin out, twin residual_out or None); ``fp8_math``: the
    twin's (``GemvConfig.fp8_math`` of the config the kernel runs)."""
    kw = dict(fp8, config=config, override=override)
    twin = dict(fp8, fp8_math=fp8_math)
    if prologue == "plain":
        return gemv(*args, **kw), None, gemv_ref(*args, **twin), None
    if prologue == "silu_mul":
        return silu_mul_gemv(*args, **kw), None, silu_mul_gemv_ref(*args, **twin), None
    out, res = add_rms_norm_gemv(*args, **kw)
    ref_out, ref_res = add_rms_norm_gemv_ref(*args, **twin)
    return out, res, ref_out, ref_res


# N, K odd; blocks ragged in both (37 = 2 x 16 + 5 rows, 201 = 3 x 64 + 9 inputs).
FP8_SCALES = {"channel": None, "block": (16, 64)}


FORMS = {"dot": dict(use_dot=1), "ew": dict(use_dot=0), "once": dict(use_dot=0, reduce_once=1)}
"""The inner-product formulations (``GemvConfig.use_dot`` / ``reduce_once``)."""


FP8_ROWS = [(1, "once", torch.bfloat16), (1, "dot", torch.float32), (2, "once", torch.float32),
            (2, "ew", torch.bfloat16), (5, "dot", torch.float32), (8, "ew", torch.bfloat16),
            (16, "dot", torch.bfloat16), (16, "once", torch.float32)]
"""(m, form, dtype) of the FP8 cases."""
FP8_CASES = [(prologue, *FP8_ROWS[(4 * p + 2 * s + r) % 8], scales)
             for p, prologue in enumerate(PROLOGUES) for s, scales in enumerate(FP8_SCALES) for r in range(2)]
"""Each prologue with each scale layout on two rows: every row twice, every form with every prologue and
with each scale layout."""


@pytest.mark.parametrize("prologue,m,form,dtype,scales", FP8_CASES)
def test_fp8_matches_twin(prologue, m, form, dtype, scales):
    """The e4m3 weight with its scales against the twin (dequantize, then the float32 reference)."""
    scale_block = FP8_SCALES[scales]
    args, fp8 = _fp8_case(prologue, m, 37, 201, dtype, scale_block)
    config = GemvConfig(block_n=16, block_k=32 if scale_block else 64, num_warps=4, num_stages=1, **FORMS[form])
    out, res, ref_out, ref_res = _run_fp8(prologue, args, fp8, config)
    rtol, atol = _tol(dtype)
    assert out.dtype == dtype and out.shape == (m, 37)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=rtol, atol=atol)
    if prologue == "add_rmsnorm":
        torch.testing.assert_close(res.float(), ref_res.float(), rtol=2 ** -7, atol=1e-6)
    # The scales matter: the same e4m3 weight without them is a different product.
    unscaled = dict(weight_scale=torch.ones_like(fp8["weight_scale"]), scale_block=scale_block)
    assert not torch.allclose(out.float(), _run_fp8(prologue, args, unscaled, config)[0].float(),
                              rtol=rtol, atol=atol)


@pytest.mark.parametrize("prologue,dtype,m", pairwise(PROLOGUES, [torch.float32, torch.bfloat16], [1, 3, 16]))
def test_reduce_once_matches_twin(prologue, dtype, m):
    """Float weights through the elementwise form reduced once over K (K tail, bias, strided rows)."""
    config = GemvConfig(block_n=16, block_k=64, num_warps=4, num_stages=1, use_dot=0, reduce_once=1)
    _check(prologue, _case(prologue, m, 40, 200, dtype, True, True), config, dtype)


@pytest.mark.parametrize("prologue", PROLOGUES)
def test_fp8_default_config_block_scales(prologue):
    """config=None with 32-input scale blocks: the default block_k is cut to 32 (no chunk straddles a
    block), also under an override asking for more."""
    args, fp8 = _fp8_case(prologue, 3, 24, 136, torch.float32, (8, 32))
    for override in ((), (("block_k", 128),)):
        out, _, ref, _ = _run_fp8(prologue, args, fp8, None, override)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_fp8_gemv_config():
    """Block-scaled FP8 weights: block_k is cut to divide the scale blocks, also under an override."""
    assert gemv_config(1, 6144, 4096).block_k == 512
    assert gemv_config(1, 6144, 4096, scale_block_k=128).block_k == 128
    assert gemv_config(1, 6144, 4096, override=(("block_k", 1024),), scale_block_k=128).block_k == 128
    assert gemv_config(1, 6144, 4096, override=(("block_k", 64),), scale_block_k=128).block_k == 64
    assert gemv_config(1, 6144, 4096, scale_block_k=96).block_k == 32


def test_fp8_checks_reject_bad_inputs():
    x = torch.randn(2, 64, device=DEVICE)
    wq = torch.randn(24, 64, device=DEVICE).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="weight_scale"):
        gemv(x, wq)                                                          # e4m3 without scales
    with pytest.raises(ValueError, match="weight_scale: expected shape"):
        gemv(x, wq, weight_scale=torch.ones(23, device=DEVICE))
    with pytest.raises(ValueError, match="weight_scale: dtype"):
        gemv(x, wq, weight_scale=torch.ones(24, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="weight_scale: expected shape"):
        gemv(x, wq, weight_scale=torch.ones(24, device=DEVICE), scale_block=(16, 32))
    with pytest.raises(ValueError, match="multiple of 16"):
        gemv(x, wq, weight_scale=torch.ones(3, 8, device=DEVICE), scale_block=(8, 8))
    with pytest.raises(ValueError, match="scale_block"):
        gemv(x, wq, weight_scale=torch.ones(2, 2, device=DEVICE), scale_block=[16, 32])
    with pytest.raises(ValueError, match="block_k"):
        gemv(x, wq, weight_scale=torch.ones(2, 2, device=DEVICE), scale_block=(16, 32),
             config=GemvConfig(block_n=16, block_k=64))
    with pytest.raises(ValueError, match="float8_e4m3fn weight only"):
        gemv(x, torch.randn(24, 64, device=DEVICE), weight_scale=torch.ones(24, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", [None, GemvConfig(32, 128, 4, 3, 1), GemvConfig(32, 128, 4, 3, 0, reduce_once=1)],
                         ids=["default", "dot", "once"])
@pytest.mark.parametrize("scales", [None, (128, 128)], ids=["channel", "block"])
@pytest.mark.parametrize("m", [1, 2, 16])
@pytest.mark.parametrize("prologue,n,k", CUDA_CASES)
def test_gpu_fp8_real_sizes(prologue, n, k, m, scales, config):
    """Llama-3-8B shapes with e4m3 weights, bfloat16 activations: the default configs (one row: the
    reduce-once form and its PTX e4m3 conversion), tl.dot and reduce-once tiles."""
    if config is not None and config.reduce_once and m == 16:
        pytest.skip("16 rows x 32 x 128 partial sums per thread: not a tile anyone runs")
    args, fp8 = _fp8_case(prologue, m, n, k, torch.bfloat16, scales)
    out, res, ref_out, ref_res = _run_fp8(prologue, args, fp8, config)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
    if prologue == "add_rmsnorm":
        assert torch.equal(res, ref_res)
