"""Tiled GEMM (``kernels.gemm``, pointer and TMA loads): the Triton kernel against its torch twin
``gemm_ref``. CPU tensors run through the interpreter with 16-wide tiles (M / N / K tails, bias,
a strided x, a given ``out``); the CUDA tests run Llama-3-8B projection sizes at decode batches."""

from __future__ import annotations

import pytest
import torch

from kernels.gemm import GemmConfig, gemm, gemm_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def _inputs(m: int, n: int, k: int, dtype, bias: bool, strided: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 7 * m + 131 * n + k)
    xb = torch.randn(m, k + (24 if strided else 0), generator=g).to(dtype).to(DEVICE)
    x = xb[:, 8:8 + k] if strided else xb                                  # [m, k], row stride >= k
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)   # [n, k]
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (17, 40, 48), (33, 64, 100), (64, 48, 16)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("strided", [False, True])
def test_gemm_matches_twin(dtype, m, n, k, bias, strided):
    if DEVICE.type == "cuda" and dtype == torch.float32:
        pytest.skip("float32 runs tf32 tensor cores on CUDA; the CPU interpreter covers exact float32")
    x, w, b = _inputs(m, n, k, dtype, bias, strided)
    cfg = GemmConfig(16, 16, 16, 1, 1, 0) if DEVICE.type == "cpu" else GemmConfig(64, 64, 32, 4, 3, 0)
    out = gemm(x, w, b, config=cfg)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, gemm_ref(x, w, b), rtol=rtol, atol=atol)


@pytest.mark.parametrize("m,n,k", [(20, 32, 48), (64, 80, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_tma_matches_twin(m, n, k, bias):
    dtype = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16   # interpreter: fp32 only (bf16 math)
    x, w, b = _inputs(m, n, k, dtype, bias, strided=False, seed=1)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    cfg = GemmConfig(16, 16, 16, 1, 1, 1) if DEVICE.type == "cpu" else GemmConfig(64, 64, 32, 4, 3, 1)
    res = gemm(x, w, b, config=cfg, out=out)
    assert res is out
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, gemm_ref(x, w, b), rtol=rtol, atol=atol)


def test_gemm_checks_its_arguments():
    x = torch.randn(4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        gemm(x, torch.randn(8, 16, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        gemm(x, torch.randn(8, 32, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias"):
        gemm(x, torch.randn(8, 32, device=DEVICE), torch.randn(9, device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        gemm(x, torch.randn(8, 32, device=DEVICE), config=GemmConfig(block_m=24))
    with pytest.raises(ValueError, match="TMA"):   # 33 float32 columns: rows not 16-byte aligned
        gemm(x, torch.randn(33, 32, device=DEVICE), config=GemmConfig(16, 16, 16, 1, 1, 1))


def test_gemm_empty_k_gives_bias():
    x = torch.randn(3, 0, device=DEVICE)
    b = torch.randn(5, device=DEVICE)
    torch.testing.assert_close(gemm(x, torch.randn(5, 0, device=DEVICE), b), b.expand(3, 5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [64, 256])
@pytest.mark.parametrize("tma", [0, 1])
def test_gemm_real_sizes_cuda(n, k, m, tma):
    x, w, _ = _inputs(m, n, k, torch.bfloat16, bias=False, strided=False)
    out = gemm(x, w, config=GemmConfig(64, 128, 64, 4, 4, tma))
    torch.testing.assert_close(out, gemm_ref(x, w), rtol=2e-2, atol=2e-2)
