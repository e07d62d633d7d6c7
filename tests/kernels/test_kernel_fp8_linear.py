"""FP8 linear kernels (``kernels.fp8_linear``): activation quantization and the W8A8 GEMM against their torch
twins; weight quantization round trip; wrapper checks. CPU tensors run through the interpreter with small
tiles (N and K tails, ragged weight blocks); the CUDA tests run Llama-3-8B sizes."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_linear import (FP8_DTYPE, FP8_MAX, MIN_AMAX, PER_TOKEN, PER_TOKEN_GROUP, STATIC, Fp8GemmConfig,
                                Fp8QuantConfig, dequantize_fp8_weight, fp8_gemm_config, fp8_linear, fp8_linear_ref,
                                quantize_activations_fp8, quantize_activations_fp8_ref, quantize_weight_fp8_per_channel,
                                scaled_mm_works)
from tests.kernels.pairwise import pairwise

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CPU_ONLY = pytest.mark.skipif(DEVICE.type != "cpu", reason="interpreter tile sizes")


def _gen(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) % (1 << 31))


def _x(m: int, k: int, dtype, g, strided: bool = False, scale: float = 1.0) -> torch.Tensor:
    """[m, k] activations with a few outlier columns; with ``strided`` a column slice of a wider buffer."""
    buf = scale * torch.randn(m, k + (16 if strided else 0), generator=g)
    buf[:, ::17] *= 8                                                      # outliers set the row scales
    buf = buf.to(dtype).to(DEVICE)
    return buf[:, 8:8 + k] if strided else buf


def _block_weight(n: int, k: int, block_size, g) -> tuple[torch.Tensor, torch.Tensor]:
    """(w [n, k] fp8, scale [cdiv(n, BN), cdiv(k, BK)]) of a random block-quantized weight."""
    bn, bk = block_size
    w = (torch.randn(n, k, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    scale = (torch.rand(-(-n // bn), -(-k // bk), generator=g) + 0.5) / (100 * k ** 0.5)
    return w.to(DEVICE), scale.to(DEVICE)


def _channel_weight(n: int, k: int, g) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t.to(DEVICE) for t in quantize_weight_fp8_per_channel(torch.randn(n, k, generator=g) / k ** 0.5))


FP8_MMA_RTOL = 2 ** -7
"""Hopper's FP8 tensor-core tiles (the GEMM's warpgroup MMA, more than 16 rows on CUDA) accumulate in reduced
precision (about 14 bits, DeepSeek-V3's report) before float32: outputs are that close, not one rounding."""


def _assert_close(out: torch.Tensor, ref: torch.Tensor, fp8_mma: bool = False) -> None:
    """One rounding of out's dtype apart at most (the GEMMs differ from the twins in float32 summation order);
    ``fp8_mma``: ``FP8_MMA_RTOL``."""
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.is_contiguous()
    rtol = dict(float32=1e-5, float16=2e-3, bfloat16=1.6e-2)[str(out.dtype).split(".")[1]]
    if fp8_mma:
        rtol = max(rtol, FP8_MMA_RTOL)
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=rtol * ref.abs().max().item() / 16)


def _wgmma(m: int) -> bool:
    """The CUDA GEMM runs ``m`` rows in warpgroup MMA tiles (``FP8_MMA_RTOL``)."""
    return DEVICE.type == "cuda" and m > 16


# ----------------------------------------------------------------------------------------
# Activation quantization
# ----------------------------------------------------------------------------------------
QUANT_SCHEMES = [(PER_TOKEN, 200, None), (PER_TOKEN_GROUP, 256, 128), (PER_TOKEN_GROUP, 200, 64),
                 (STATIC, 200, None)]
"""(scheme, K, group) of the quantization cases."""


@pytest.mark.parametrize("dtype,m,scheme_k_group",
                         pairwise([torch.bfloat16, torch.float16, torch.float32], [1, 5, 40], QUANT_SCHEMES))
def test_quantize_matches_twin(dtype, m, scheme_k_group):
    """Bit-exact fp8 values and scales (rows strided for bf16; K groups with a tail for group 64); every
    pair of dtype, row count and scheme."""
    scheme, k, group = scheme_k_group
    x = _x(m, k, dtype, _gen(m, k), strided=dtype == torch.bfloat16)
    input_scale = torch.tensor(0.02, device=DEVICE) if scheme == STATIC else None
    kwargs = dict(input_scale=input_scale, group_size=group or 128)
    q, s = quantize_activations_fp8(x, scheme, **kwargs)
    q_ref, s_ref = quantize_activations_fp8_ref(x, scheme, **kwargs)
    assert q.dtype == FP8_DTYPE and q.shape == (m, k) and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == s_ref.shape
    assert s.shape == {PER_TOKEN: (m, 1), STATIC: (1,), PER_TOKEN_GROUP: (m, -(-k // (group or 1)))}[scheme]
    assert torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())          # float compare: the interpreter writes -0 as +0


def test_quantize_rounds_to_nearest_even():
    """Every e4m3 value, every midpoint between neighbours (ties to even) and its float32 neighbours,
    random magnitudes over 40 binades, and saturation: equal to torch's conversion (STATIC, scale 1)."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[~grid.isnan()].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    v = torch.cat([grid, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1),
                   torch.randn(4000, generator=g) * torch.exp2(torch.randint(-20, 20, (4000,), generator=g)),
                   torch.tensor([460.0, -1000.0, 1e30, 1e-30])])
    x = v.view(1, -1).to(DEVICE)
    q, _ = quantize_activations_fp8(x, STATIC, torch.ones(1, device=DEVICE))
    assert torch.equal(q.float().cpu(), v.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float().view(1, -1))


def test_quantize_zero_row_and_scale_floor():
    """A zero row gets scale MIN_AMAX / 448 and zero values; M = 0 launches nothing."""
    x = torch.zeros(2, 64, device=DEVICE, dtype=torch.bfloat16)
    x[1, 3] = 2.0
    q, s = quantize_activations_fp8(x, PER_TOKEN)
    assert s[0, 0].item() == pytest.approx(MIN_AMAX / FP8_MAX) and s[1, 0].item() == pytest.approx(2.0 / FP8_MAX)
    assert (q[0].float() == 0).all() and q[1, 3].float().item() == FP8_MAX
    q, s = quantize_activations_fp8(x[:0], PER_TOKEN_GROUP, group_size=32)
    assert q.shape == (0, 64) and s.shape == (0, 2)


def test_quantize_config_chunks():
    """An explicit config with 16-wide chunks over 128-wide groups (8 chunks each) and whole rows."""
    x = _x(3, 200, torch.bfloat16, _gen(3, 200))
    for scheme in (PER_TOKEN, PER_TOKEN_GROUP):
        q, s = quantize_activations_fp8(x, scheme, config=Fp8QuantConfig(block_k=16, num_warps=1))
        q_ref, s_ref = quantize_activations_fp8_ref(x, scheme)
        assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())


# ----------------------------------------------------------------------------------------
# W8A8 GEMM
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,scheme,bias_out", pairwise([1, 5, 16, 40], [PER_TOKEN, STATIC, PER_TOKEN_GROUP],
                                                       [(False, None), (True, torch.float32)]))
def test_linear_per_channel(m, scheme, bias_out):
    """Per-channel weights, N = 72 and K = 96 (tails of the 32-wide interpreter tiles, N not a multiple of
    128); per-token-group activations in 32-wide groups; every pair of row count, scheme and bias / out
    dtype."""
    bias, out_dtype = bias_out
    n, k = 72, 96
    g = _gen(m, n, k)
    x = _x(m, k, torch.bfloat16, g)
    w, w_scale = _channel_weight(n, k, g)
    kwargs = dict(activation_scheme=scheme, bias=torch.randn(n, generator=g).to(DEVICE) if bias else None,
                  out_dtype=out_dtype, input_scale=torch.tensor([0.03], device=DEVICE) if scheme == STATIC else None,
                  group_size=32 if scheme == PER_TOKEN_GROUP else None)
    _assert_close(fp8_linear(x, w, w_scale, backend="triton", **kwargs), fp8_linear_ref(x, w, w_scale, **kwargs),
                  _wgmma(m))


BLOCK_SCHEMES = [(PER_TOKEN_GROUP, False, None), (PER_TOKEN_GROUP, True, torch.float32),
                 (PER_TOKEN, True, None)]
"""(scheme, bias, out_dtype) of the block-scale cases."""
BLOCK_SHAPES = [(256, 256, (128, 128)), (200, 320, (128, 128)), (80, 112, (32, 64))]
"""(N, K, block_size) of the block-scale cases."""


@pytest.mark.parametrize("m,shape,block_scheme", pairwise([1, 5, 16, 40], BLOCK_SHAPES, BLOCK_SCHEMES))
def test_linear_block(m, shape, block_scheme):
    """Block weight scales: K, N multiples of 128, ragged last blocks (200 = 128 + 72, 320 = 2 x 128 + 64),
    and small blocks with ragged K (112 = 64 + 48); activations per K group (G = BK) or per token; every
    pair of row count, shape and scheme."""
    (n, k, block_size), (scheme, bias, out_dtype) = shape, block_scheme
    g = _gen(m, n, k)
    x = _x(m, k, torch.bfloat16, g, strided=m == 5)
    w, w_scale = _block_weight(n, k, block_size, g)
    kwargs = dict(activation_scheme=scheme, block_size=block_size, out_dtype=out_dtype,
                  bias=torch.randn(n, generator=g).to(torch.bfloat16).to(DEVICE) if bias else None)
    _assert_close(fp8_linear(x, w, w_scale, **kwargs), fp8_linear_ref(x, w, w_scale, **kwargs), _wgmma(m))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_linear_dtypes(dtype, out_dtype):
    g = _gen(7, 48, 64)
    x = _x(7, 64, dtype, g)
    w, w_scale = _channel_weight(48, 64, g)
    kwargs = dict(activation_scheme=PER_TOKEN, out_dtype=out_dtype)
    out = fp8_linear(x, w, w_scale, **kwargs)
    assert out.dtype == (out_dtype or dtype)
    _assert_close(out, fp8_linear_ref(x, w, w_scale, **kwargs))


def test_linear_close_to_unquantized():
    """FP8_DYNAMIC-style quantization of a bf16 linear: within a few percent of the 16-bit result."""
    g = _gen(1, 2, 3)
    x = _x(16, 256, torch.float32, g)
    w = torch.randn(64, 256, generator=g).to(DEVICE) / 16
    w_fp8, w_scale = quantize_weight_fp8_per_channel(w)
    out = fp8_linear(x, w_fp8, w_scale, activation_scheme=PER_TOKEN)
    exact = x @ w.t()
    assert ((out - exact).norm() / exact.norm()).item() < 0.05


@CPU_ONLY
def test_linear_explicit_config():
    """An explicit config: 2 x 2 row tiles grouped (group_m 2) over 3 column tiles, 16-wide K steps in 64-wide
    K groups."""
    g = _gen(40, 48, 128)
    x = _x(40, 128, torch.bfloat16, g)
    w, w_scale = _block_weight(48, 128, (16, 64), g)
    kwargs = dict(activation_scheme=PER_TOKEN_GROUP, block_size=(16, 64), out_dtype=torch.float32)
    out = fp8_linear(x, w, w_scale, config=Fp8GemmConfig(16, 16, 16, 2, 4, 1), **kwargs)
    _assert_close(out, fp8_linear_ref(x, w, w_scale, **kwargs))


def test_linear_zero_rows():
    w, w_scale = _channel_weight(24, 32, _gen(0))
    out = fp8_linear(torch.zeros(0, 32, device=DEVICE), w, w_scale, activation_scheme=PER_TOKEN, backend="triton")
    assert out.shape == (0, 24)


@pytest.mark.skipif(not scaled_mm_works(DEVICE), reason="torch._scaled_mm with rowwise scales unavailable")
@pytest.mark.parametrize("scheme,bias", [(PER_TOKEN, False), (STATIC, True)])
def test_linear_scaled_mm_backend(scheme, bias):
    """torch._scaled_mm (rowwise scales, bf16 out) against the twin: one bf16 rounding apart."""
    g = _gen(5, 48, 64)
    x = _x(5, 64, torch.bfloat16, g)
    w, w_scale = _channel_weight(48, 64, g)
    kwargs = dict(activation_scheme=scheme, input_scale=torch.tensor(0.03, device=DEVICE) if scheme == STATIC else None,
                  bias=torch.randn(48, generator=g).to(torch.bfloat16).to(DEVICE) if bias else None)
    _assert_close(fp8_linear(x, w, w_scale, backend="scaled_mm", **kwargs), fp8_linear_ref(x, w, w_scale, **kwargs))


# ----------------------------------------------------------------------------------------
# Weight quantization
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_round_trip(dtype):
    """|W - dequant(quant(W))| <= half an e4m3 step: 2^-4 relative (3 mantissa bits), 2^-10 * scale in the
    subnormal range; the row's amax maps to 448 exactly."""
    g = _gen(9)
    w = (torch.randn(33, 80, generator=g) * torch.exp2(torch.randint(-6, 6, (33, 1), generator=g))).to(dtype)
    w[3] = 0.0                                                             # an all-zero row: eps scale
    w_fp8, scale = quantize_weight_fp8_per_channel(w)
    assert w_fp8.dtype == FP8_DTYPE and scale.shape == (33,) and scale.dtype == torch.float32
    assert scale[3].item() == torch.finfo(torch.float32).eps and (w_fp8[3].float() == 0).all()
    err = (dequantize_fp8_weight(w_fp8, scale) - w.float()).abs()
    bound = torch.maximum(w.float().abs() * 2 ** -4, scale[:, None] * 2 ** -10) * (1 + 1e-6)
    assert (err <= bound).all()
    assert (w_fp8.float().abs().amax(dim=1)[torch.arange(33) != 3] == FP8_MAX).all()


def test_dequantize_block_ragged():
    g = _gen(11)
    w, scale = _block_weight(5, 7, (2, 3), g)
    out = dequantize_fp8_weight(w, scale, (2, 3))
    for n in range(5):
        for k in range(7):
            assert out[n, k].item() == (w[n, k].float() * scale[n // 2, k // 3]).item()


# ----------------------------------------------------------------------------------------
# Configs and checks
# ----------------------------------------------------------------------------------------
def test_config_pickers():
    cuda = torch.device("cuda")
    assert fp8_gemm_config(1, 6144, 4096, cuda, k_group=128).block_k == 128
    assert fp8_gemm_config(2048, 6144, 4096, cuda).block_m == 128
    assert fp8_gemm_config(4, 4096, 4096, cuda, k_group=64).block_k == 64
    with pytest.raises(ValueError, match="block_m"):
        Fp8GemmConfig(block_m=8)
    with pytest.raises(ValueError, match="group_m"):
        Fp8GemmConfig(group_m=0)
    with pytest.raises(ValueError, match="num_stages"):
        Fp8GemmConfig(num_stages=0)
    with pytest.raises(ValueError, match="block_k"):
        Fp8QuantConfig(block_k=8)


def test_checks_reject_bad_inputs():
    g = _gen(1)
    x = _x(2, 64, torch.bfloat16, g)
    w, w_scale = _channel_weight(32, 64, g)
    wb, sb = _block_weight(32, 64, (16, 32), g)
    lin = dict(activation_scheme=PER_TOKEN)
    with pytest.raises(ValueError, match="w: dtype"):
        fp8_linear(x, w.float(), w_scale, **lin)
    with pytest.raises(ValueError, match="w: expected shape"):
        fp8_linear(x, w[:, :32].contiguous(), w_scale, **lin)                   # K mismatch
    with pytest.raises(ValueError, match="w: must be contiguous"):
        fp8_linear(x[:, :32], w[:, ::2], w_scale, **lin)
    with pytest.raises(ValueError, match="w_scale: expected shape"):
        fp8_linear(x, w, w_scale[:31], **lin)
    with pytest.raises(ValueError, match="w_scale: dtype"):
        fp8_linear(x, w, w_scale.half(), **lin)
    with pytest.raises(ValueError, match=r"w_scale: expected shape \(2, 1\)"):
        fp8_linear(x, wb, sb, block_size=(16, 64), **lin)
    with pytest.raises(ValueError, match="block_size"):
        fp8_linear(x, wb, sb, block_size=(16,), **lin)
    with pytest.raises(ValueError, match="x: dtype"):
        fp8_linear(x.to(FP8_DTYPE), w, w_scale, **lin)
    with pytest.raises(ValueError, match="x: last dim must have stride 1"):
        fp8_linear(torch.randn(64, 2, device=DEVICE).t(), w, w_scale, **lin)
    with pytest.raises(ValueError, match="bias"):
        fp8_linear(x, w, w_scale, bias=torch.zeros(31, device=DEVICE), **lin)
    with pytest.raises(ValueError, match="activation_scheme"):
        fp8_linear(x, w, w_scale, activation_scheme="dynamic")
    with pytest.raises(ValueError, match="input_scale: expected a torch.Tensor"):
        fp8_linear(x, w, w_scale, activation_scheme=STATIC)
    with pytest.raises(ValueError, match="input_scale: expected one value"):
        fp8_linear(x, w, w_scale, activation_scheme=STATIC, input_scale=torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="only 'static' takes one"):
        fp8_linear(x, w, w_scale, input_scale=torch.ones(1, device=DEVICE), **lin)
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_linear(x, w, w_scale, out_dtype=torch.int8, **lin)
    with pytest.raises(ValueError, match="backend"):
        fp8_linear(x, w, w_scale, backend="cublas", **lin)
    with pytest.raises(ValueError, match="'scaled_mm' does not apply: block"):
        fp8_linear(x, wb, sb, block_size=(16, 32), backend="scaled_mm", activation_scheme=PER_TOKEN_GROUP)
    with pytest.raises(ValueError, match="'scaled_mm' does not apply: out_dtype"):
        fp8_linear(x, w, w_scale, backend="scaled_mm", out_dtype=torch.float32, **lin)
    with pytest.raises(ValueError, match=r"block_k: 32 must divide block_size\[1\] \(16\)"):
        fp8_linear(x, w, w_scale.view(32, 1).expand(32, 4).contiguous(), block_size=(1, 16),
                   config=Fp8GemmConfig(16, 16, 32, 1, 4, 1), **lin)
    with pytest.raises(ValueError, match="config"):
        fp8_linear(x, w, w_scale, config=dict(block_m=16), **lin)
    with pytest.raises(ValueError, match="w: on"):
        fp8_linear(x, torch.empty(32, 64, dtype=FP8_DTYPE, device="meta"), w_scale, **lin)
    with pytest.raises(ValueError, match="group_size"):
        quantize_activations_fp8(x, PER_TOKEN_GROUP, group_size=0)
    with pytest.raises(ValueError, match="input_scale: dtype"):
        quantize_activations_fp8(x, STATIC, torch.ones(1, device=DEVICE, dtype=torch.float16))


# ----------------------------------------------------------------------------------------
# CUDA: Llama-3-8B sizes
# ----------------------------------------------------------------------------------------
CUDA_SHAPES = [(6144, 4096), (4096, 14336), (28672, 4096)]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "auto"])
@pytest.mark.parametrize("m", [1, 16, 200])
@pytest.mark.parametrize("n,k", CUDA_SHAPES)
def test_cuda_linear_llama_sizes(n, k, m, backend):
    g = _gen(m, n, k)
    x = _x(m, k, torch.bfloat16, g)
    w, w_scale = _channel_weight(n, k, g)
    _assert_close(fp8_linear(x, w, w_scale, activation_scheme=PER_TOKEN, backend=backend),
                  fp8_linear_ref(x, w, w_scale, activation_scheme=PER_TOKEN), _wgmma(m))
    wb, sb = _block_weight(n, k, (128, 128), g)
    kwargs = dict(activation_scheme=PER_TOKEN_GROUP, block_size=(128, 128))
    _assert_close(fp8_linear(x, wb, sb, **kwargs), fp8_linear_ref(x, wb, sb, **kwargs), _wgmma(m))
    q, s = quantize_activations_fp8(x, PER_TOKEN_GROUP)
    q_ref, s_ref = quantize_activations_fp8_ref(x, PER_TOKEN_GROUP)
    assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())

