"""The AMX int4 and int8 GEMMs against their twins (skipped where the CPU or the OS grants no AMX tiles)."""

from __future__ import annotations

import pytest
import torch

from engine.layers.quantized import (BF16_PRODUCTS_MIN_TOKENS, FP16_COPY_MIN_TOKENS, AmxTiles, Bf16Weight,
                                     Int4Weight, Int8Weight, QuantizedEmbedding, _cpu_kernel, quantized_linear)
from kernels.cpu_amx_gemm import CpuAmxGemm, supports
from kernels.reference import int4_gemm_ref, int8_gemm_ref

SHAPES = [(960, 576), (80, 64), (48, 1536), (16, 32)]          # 80: a last group of one column block


@pytest.fixture(scope="module")
def gemm(tmp_path_factory) -> CpuAmxGemm:
    loaded = CpuAmxGemm.load(tmp_path_factory.mktemp("cpu_kernels"))
    if loaded is None:
        pytest.skip("no AMX tiles on this CPU (or no C compiler)")
    return loaded


def _int4(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    low = -8 * scales + torch.randn(n, k // 32, generator=g) * 0.01
    return q, scales, low


def _rows(rows: int, k: int) -> torch.Tensor:
    return torch.randn(rows, k + 16, generator=torch.Generator().manual_seed(k))[:, 8:8 + k]    # strided rows


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])                 # partial and several row tiles
@pytest.mark.parametrize("n,k", SHAPES)
def test_int4_gemm_matches_ref(gemm, rows, n, k):
    q, scales, low = _int4(n, k, rows * n + k)
    x = _rows(rows, k)
    out = gemm.int4(x, gemm.pack_int4(q, scales, low), n, num_threads=2)
    ref = int4_gemm_ref(x, q, scales, low)
    # a weight's multiply-add may be fused in C: one bfloat16 step apart now and then
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3 * float(ref.abs().max()))


@pytest.mark.parametrize("rows", [1, 16, 17])
@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_gemm_matches_ref(gemm, rows, n, k):
    g = torch.Generator().manual_seed(rows * n + k)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) * 0.01
    x = _rows(rows, k)
    out = gemm.int8(x, gemm.pack_int8(q), scales, num_threads=2)
    torch.testing.assert_close(out, int8_gemm_ref(x, q, scales), rtol=1e-5, atol=1e-5)   # exact up to sum order


def test_amx_gemm_refuses_bad_shapes(gemm):
    assert not supports(24, 64) and not supports(32, 48) and supports(32, 64)
    q, scales, low = _int4(32, 64, 0)
    with pytest.raises(ValueError, match="N % 16"):
        gemm.pack_int4(q[:24], scales[:24], low[:24])
    with pytest.raises(ValueError, match="do not pack"):
        gemm.int4(torch.randn(2, 64), gemm.pack_int4(q, scales, low)[:-1], 32)
    with pytest.raises(ValueError, match="do not pack"):
        gemm.int8(torch.randn(2, 64), gemm.pack_int4(q, scales, low), torch.ones(32))   # int4 records as int8


@pytest.mark.parametrize("kind", [Int4Weight, Int8Weight])
def test_quantized_weight_decode_rows_take_the_tiles(gemm, kind):
    """A weight with AMX copies runs 5-19 rows through the tiles: the bf16 copy's products without its bfloat16
    output rounding; 1-4 rows stay on the packed kernel, 20+ on the bf16-products copy."""
    torch.manual_seed(0)
    w = kind(torch.randn(192, 576) * 0.05)
    w.keep_float_copies(amx=True, amx_gemm=gemm)
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


def test_quantized_head_batches_take_the_tiles(gemm):
    """An LM head with AMX tiles (what the builder keeps with AMX): float32 logits from the tiles from
    ``FP16_COPY_MIN_TOKENS`` rows, from the fp16 copy below."""
    torch.manual_seed(0)
    head = QuantizedEmbedding(torch.randn(512, 64) * 0.5, "int8")
    head.weight_q.keep_float_copies(amx=False)
    head.weight_q.amx_tiles = AmxTiles(gemm, head.weight_q)
    exact = lambda h: h @ head.weight_q.dequantize(torch.float32).T
    few, many = torch.randn(FP16_COPY_MIN_TOKENS - 1, 64) * 4, torch.randn(FP16_COPY_MIN_TOKENS, 64) * 4
    torch.testing.assert_close(head.logits(few), head.weight_q.fp16_copy.packed_mm(few), atol=0, rtol=0)
    logits = head.logits(many)
    assert logits.dtype == torch.float32 and bool((logits != logits.bfloat16().float()).any())
    torch.testing.assert_close(logits, head.weight_q.amx_tiles.packed_mm(many), atol=0, rtol=0)
    torch.testing.assert_close(logits, exact(many), atol=float(2 ** -8 * exact(many).abs().max()), rtol=0)
