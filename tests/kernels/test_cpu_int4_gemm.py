"""The AMX int4 GEMM against its twin (skipped where the CPU or the OS grants no AMX tiles)."""

from __future__ import annotations

import pytest
import torch

from engine.layers.quantized import BF16_PRODUCTS_MIN_TOKENS, Bf16Weight, Int4Weight, _cpu_kernel, quantized_linear
from kernels.cpu_int4_gemm import CpuInt4Gemm, supports
from kernels.reference import int4_gemm_ref


@pytest.fixture(scope="module")
def gemm(tmp_path_factory) -> CpuInt4Gemm:
    loaded = CpuInt4Gemm.load(tmp_path_factory.mktemp("cpu_kernels"))
    if loaded is None:
        pytest.skip("no AMX tiles on this CPU (or no C compiler)")
    return loaded


def _int4(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    low = -8 * scales + torch.randn(n, k // 32, generator=g) * 0.01
    return q, scales, low


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])                 # partial and several row tiles
@pytest.mark.parametrize("n,k", [(960, 576), (80, 64), (48, 1536), (16, 32)])   # 80: a group of one block
def test_int4_gemm_matches_ref(gemm, rows, n, k):
    q, scales, low = _int4(n, k, rows * n + k)
    x = torch.randn(rows, k + 16, generator=torch.Generator().manual_seed(k))[:, 8:8 + k]   # strided rows
    out = gemm(x, gemm.pack(q, scales, low), n, num_threads=2)
    ref = int4_gemm_ref(x, q, scales, low)
    # a weight's multiply-add may be fused in C: one bfloat16 step apart now and then
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3 * float(ref.abs().max()))


def test_int4_gemm_refuses_bad_shapes(gemm):
    assert not supports(24, 64, 32) and not supports(32, 48, 32) and not supports(32, 64, 64)
    q, scales, low = _int4(32, 64, 0)
    with pytest.raises(ValueError, match="N % 16"):
        gemm.pack(q[:24], scales[:24], low[:24])
    with pytest.raises(ValueError, match="do not pack"):
        gemm(torch.randn(2, 64), gemm.pack(q, scales, low)[:-1], 32)


def test_int4_weight_decode_rows_take_the_tiles(gemm):
    """An Int4Weight with AMX copies runs 5-19 rows through the tiles: the bf16 copy's products without its
    bfloat16 output rounding; 1-4 rows stay on the packed kernel, 20+ on the bf16-products copy."""
    torch.manual_seed(0)
    w = Int4Weight(torch.randn(192, 576) * 0.05)
    w.keep_float_copies(amx=True, int4_gemm=gemm)
    assert w.amx_tiles is not None and w.bf16_copy is None
    assert _cpu_kernel(w, 4) is w and _cpu_kernel(w, 5) is w.amx_tiles
    assert _cpu_kernel(w, BF16_PRODUCTS_MIN_TOKENS - 1) is w.amx_tiles
    assert _cpu_kernel(w, BF16_PRODUCTS_MIN_TOKENS) is w.bf16_products_copy
    x = torch.randn(8, 576)
    out = quantized_linear(x, w)
    assert out.dtype == torch.float32
    bf16_out = Bf16Weight(w.dequantize(torch.float32)).packed_mm(x).float()
    torch.testing.assert_close(out.to(torch.bfloat16).float(), bf16_out, rtol=1e-2, atol=1e-2)
    assert (out - out.to(torch.bfloat16).float()).abs().max() > 0          # not rounded to bfloat16
    exact = x @ w.dequantize(torch.float32).T
    torch.testing.assert_close(out, exact, rtol=0.05, atol=0.05)
