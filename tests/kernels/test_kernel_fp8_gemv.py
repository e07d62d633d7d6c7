"""FP8 decode GEMV maths that do not widen the e4m3 weight to the activations' dtype
(``GemvConfig.fp8_math``: E4M3_DOT rounds the input rows to e4m3 per row, F16_WIDEN widens the weight
to float16 and pre-scales the rows by a power of two): the Triton kernel against its torch twins
(``kernels.gemv.*_ref`` with ``fp8_math``), all three prologues, both scale kinds; and the twins'
arithmetic against the widened product and the W8A8 scheme. CPU tensors run through the interpreter
(which runs e4m3 x e4m3 and float16 dots exactly, float32 accumulation)."""

from __future__ import annotations

import pytest
import torch

from engine.kernel_policy import KernelPolicy
from kernels.fp8_linear import PER_TOKEN, fp8_linear_ref
from kernels.gemv import (E4M3_DOT, F16_WIDEN, WIDEN, GemvConfig, gemv, gemv_config, gemv_ref, round_rows_ref,
                          row_multipliers_ref)
from tests.kernels.test_kernel_gemv import DEVICE, PROLOGUES, _fp8_case, _run_fp8, _tol
from tests.kernels.pairwise import pairwise

MATHS = {"e4m3_dot": E4M3_DOT, "f16_widen": F16_WIDEN}


def _max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| over max |ref|."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def _exact_rows(prologue: str, dtype) -> bool:
    """Whether the kernel builds the input rows bit for bit as the twin: not for the prologues' bfloat16
    roundings under the interpreter, which truncates where torch rounds to nearest."""
    return prologue == "plain" or dtype != torch.bfloat16 or DEVICE.type == "cuda"


def _assert_matches_twin(out: torch.Tensor, ref: torch.Tensor, widened: torch.Tensor, dtype, math: int,
                         exact_rows: bool) -> None:
    """Within the dtype's rounding. E4M3_DOT on rows one bfloat16 ulp off the twin's (not ``exact_rows``):
    entries near an e4m3 midpoint land on the other side, a difference the size of the e4m3 rounding
    itself, so then only within 3% of the output's max and of the widened product (``widened``)."""
    rtol, atol = _tol(dtype)
    if math != E4M3_DOT or exact_rows:
        torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)
        return
    assert _max_rel(out, ref) < 0.03 and _max_rel(out, widened) < 0.06


def _config(math: int, scale_block, **kw) -> GemvConfig:
    return GemvConfig(block_n=16, block_k=32 if scale_block else 64, num_warps=4, num_stages=1, fp8_math=math, **kw)


ROWS = [(1, torch.bfloat16, 0), (2, torch.float16, 1), (5, torch.bfloat16, 1), (16, torch.bfloat16, 0)]
"""(m, dtype, swap_ab) of the FP8-math cases."""


@pytest.mark.parametrize("prologue,math,row,scales",
                         pairwise(PROLOGUES, list(MATHS), ROWS, ["channel", "block"]))
def test_fp8_math_matches_twin(prologue, math, row, scales):
    """The kernel equals its twin within the output dtype's rounding; the twin stays within the rows'
    rounding of the widened product (e4m3: what W8A8 accepts; float16: a few output ulps). swap_ab: the
    transposed accumulation (weight rows first). Every pair of prologue, math, row set and scale layout."""
    m, dtype, swap_ab = row
    scale_block = None if scales == "channel" else (16, 64)
    args, fp8 = _fp8_case(prologue, m, 37, 201, dtype, scale_block)
    config = _config(MATHS[math], scale_block, swap_ab=swap_ab)
    out, res, ref_out, ref_res = _run_fp8(prologue, args, fp8, config, fp8_math=MATHS[math])
    assert out.dtype == dtype and out.shape == (m, 37)
    widened = _run_fp8(prologue, args, fp8, None, fp8_math=WIDEN)[2]
    _assert_matches_twin(out, ref_out, widened, dtype, MATHS[math], _exact_rows(prologue, dtype))
    if prologue == "add_rmsnorm":
        torch.testing.assert_close(res.float(), ref_res.float(), rtol=2 ** -7, atol=1e-6)
    err = _max_rel(ref_out, widened)
    if MATHS[math] == E4M3_DOT:
        assert 1e-3 < err < 0.06, err            # e4m3 rows: visible, bounded
    else:
        assert err < 2e-2, err                   # float16 rows: exact up to the output's rounding


@pytest.mark.parametrize("math", list(MATHS))
def test_fp8_math_float_weight_ignores_it(math):
    """A float weight takes the float path whatever fp8_math says (the engine's override reaches every layer)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(40, 64, generator=g) / 8).to(torch.bfloat16).to(DEVICE)
    out = gemv(x, w, config=_config(MATHS[math], None))
    assert torch.equal(out, gemv(x, w, config=_config(WIDEN, None, use_dot=1)))


def test_f16_widen_float32_rows_fall_back():
    """float32 rows would lose bits in float16: F16_WIDEN runs them as WIDEN (the same launch)."""
    args, fp8 = _fp8_case("plain", 3, 37, 201, torch.float32, None)
    out = gemv(*args, **fp8, config=_config(F16_WIDEN, None))
    assert torch.equal(out, gemv(*args, **fp8, config=_config(WIDEN, None, use_dot=1)))
    torch.testing.assert_close(out, gemv_ref(*args, **fp8, fp8_math=F16_WIDEN), rtol=1e-5, atol=1e-5)


def test_e4m3_dot_is_the_w8a8_per_token_scheme():
    """Plain rows, per-channel weight: E4M3_DOT computes what the W8A8 GEMM with per-token activation
    scales computes (``fp8_linear_ref``), without a separate quantization launch."""
    args, fp8 = _fp8_case("plain", 4, 37, 201, torch.bfloat16, None)
    x, wq, bias = args
    out = gemv(x, wq, bias, **fp8, config=_config(E4M3_DOT, None))
    w8a8 = fp8_linear_ref(x, wq, fp8["weight_scale"], activation_scheme=PER_TOKEN, bias=bias)
    torch.testing.assert_close(out.float(), w8a8.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("math", list(MATHS))
def test_fp8_math_row_range(math):
    """Rows far outside float16's range (1e6, 1e-6) and an all-zero row: the row scale keeps every value
    finite and in range (F16_WIDEN) or on the e4m3 grid (E4M3_DOT); the zero row gives the bias."""
    args, fp8 = _fp8_case("plain", 3, 37, 201, torch.bfloat16, None)
    x, wq, bias = args
    x = x.clone()
    x[0] *= 1e6
    x[1] *= 1e-6
    x[2] = 0
    out = gemv(x, wq, bias, **fp8, config=_config(MATHS[math], None))
    ref = gemv_ref(x, wq, bias, **fp8, fp8_math=MATHS[math])
    widened = gemv_ref(x, wq, bias, **fp8)
    assert torch.isfinite(out).all()
    for row in range(3):
        torch.testing.assert_close(out[row].float(), ref[row].float(), rtol=2e-2,
                                   atol=2e-2 * ref[row].abs().max().item())
        assert _max_rel(ref[row] - bias, widened[row] - bias) < (0.06 if MATHS[math] == E4M3_DOT else 2e-2)
    assert torch.equal(out[2], bias)


def test_row_multipliers_ref():
    """E4M3_DOT: amax / 448 and its reciprocal; F16_WIDEN: the power of two putting amax in [2^14, 2^15)
    and its inverse, clamped for zero rows."""
    amax = torch.tensor([448.0, 1.0, 3e5, 0.0, 1e-38])
    up, down = row_multipliers_ref(amax, E4M3_DOT)
    torch.testing.assert_close(down[:2], torch.tensor([1.0, 1 / 448]))
    torch.testing.assert_close(up * down, torch.ones(5))
    up, down = row_multipliers_ref(amax, F16_WIDEN)
    scaled = amax[:3] * up[:3]
    assert ((scaled >= 2 ** 14) & (scaled < 2 ** 15)).all()
    assert torch.equal(up * down, torch.ones(5)) and torch.isfinite(up).all() and (down > 0).all()
    a = torch.tensor([[3e5, -2.5, 1e-3]])
    assert torch.equal(round_rows_ref(a, a.abs().amax(dim=1), WIDEN), a)
    torch.testing.assert_close(round_rows_ref(a, a.abs().amax(dim=1), F16_WIDEN), a, rtol=2 ** -11, atol=0)


def test_fp8_math_config():
    """fp8_math is a config field: checked, reached by the override (the engine's ``gemv`` policy group)."""
    with pytest.raises(ValueError, match="fp8_math"):
        GemvConfig(fp8_math=3)
    with pytest.raises(ValueError, match="swap_ab"):
        GemvConfig(swap_ab=2)
    with pytest.raises(ValueError, match="block_n"):
        GemvConfig(block_n=8, fp8_math=E4M3_DOT)                           # always tl.dot: >= 16
    assert gemv_config(1, 4096, 4096, override=(("fp8_math", E4M3_DOT),)).fp8_math == E4M3_DOT
    # The maths' own default tiles (swapped, wgmma) on an e4m3 weight only; a float weight keeps its tiles.
    fp8_cfg = gemv_config(1, 4096, 4096, override=(("fp8_math", E4M3_DOT),), weight_fp8=True)
    assert (fp8_cfg.block_n, fp8_cfg.block_k, fp8_cfg.swap_ab) == (64, 512, 1)
    assert gemv_config(1, 28672, 4096, override=(("fp8_math", F16_WIDEN),), weight_fp8=True).block_n == 64
    # With no override an e4m3 weight on CUDA takes E4M3_DOT (swapped tiles; 64 x 128, 6 stages on scale blocks);
    # the override's WIDEN brings back the bf16 tiles; the interpreter keeps WIDEN.
    default = gemv_config(1, 28672, 4096, weight_fp8=True)
    assert (default.fp8_math, default.block_n, default.block_k, default.swap_ab) == (E4M3_DOT, 128, 256, 1)
    blocks = gemv_config(1, 4096, 14336, weight_fp8=True, scale_block_k=128)
    assert (blocks.fp8_math, blocks.block_n, blocks.block_k, blocks.num_stages) == (E4M3_DOT, 64, 128, 6)
    widen = gemv_config(1, 4096, 4096, override=(("fp8_math", WIDEN),), weight_fp8=True)
    assert (widen.fp8_math, widen.block_n, widen.block_k, widen.swap_ab) == (WIDEN, 32, 512, 0)
    assert gemv_config(1, 4096, 4096, device=torch.device("cpu"), weight_fp8=True).fp8_math == WIDEN
    assert gemv_config(1, 4096, 4096, override=(("fp8_math", E4M3_DOT), ("block_n", 128)), weight_fp8=True,
                       scale_block_k=128).block_k == 128
    float_cfg = gemv_config(1, 4096, 4096, override=(("fp8_math", E4M3_DOT),))
    assert (float_cfg.block_n, float_cfg.swap_ab) == (gemv_config(1, 4096, 4096).block_n, 0)
    assert GemvConfig(fp8_math=E4M3_DOT).for_operands(True, torch.bfloat16).use_dot == 1
    assert GemvConfig(fp8_math=F16_WIDEN).for_operands(True, torch.float32).fp8_math == WIDEN
    assert GemvConfig(fp8_math=E4M3_DOT).for_operands(False, torch.bfloat16).fp8_math == WIDEN
    assert GemvConfig(block_k=16, fp8_math=E4M3_DOT).for_operands(True, torch.bfloat16).fp8_math == WIDEN
    policy = KernelPolicy().with_overrides("gemv.fp8_math=1")
    assert dict(policy.gemv)["fp8_math"] == E4M3_DOT
    with pytest.raises(ValueError, match="fp8_math"):
        KernelPolicy().with_overrides("gemv.fp8_math=5")


# ----------------------------------------------------------------------------------------
# CUDA: Llama-3-8B decode sizes
# ----------------------------------------------------------------------------------------
CUDA_CASES = [("plain", 6144, 4096), ("plain", 4096, 4096), ("plain", 28672, 4096), ("plain", 4096, 14336),
              ("silu_mul", 4096, 14336), ("add_rmsnorm", 6144, 4096), ("add_rmsnorm", 28672, 4096),
              ("rmsnorm", 6144, 4096)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_n,block_k,swap_ab", [(32, 128, 0), (64, 256, 1), (128, 128, 1)])
@pytest.mark.parametrize("scales", [None, (128, 128)], ids=["channel", "block"])
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("math", list(MATHS))
@pytest.mark.parametrize("prologue,n,k", CUDA_CASES)
def test_gpu_fp8_math_real_sizes(prologue, n, k, math, m, scales, block_n, block_k, swap_ab):
    """Llama-3-8B shapes, bfloat16 rows: the FP8 MMA / float16 dots (mma.sync, or wgmma with swap_ab)
    against their twins."""
    if scales is not None and block_k > 128:
        block_k = 128
    args, fp8 = _fp8_case(prologue, m, n, k, torch.bfloat16, scales)
    config = GemvConfig(block_n, block_k, 4, 3, 1, fp8_math=MATHS[math], swap_ab=swap_ab)
    out, res, ref_out, ref_res = _run_fp8(prologue, args, fp8, config, fp8_math=MATHS[math])
    widened = _run_fp8(prologue, args, fp8, None)[2]
    _assert_matches_twin(out, ref_out, widened, torch.bfloat16, MATHS[math], True)
    if prologue == "add_rmsnorm":
        assert torch.equal(res, ref_res)
