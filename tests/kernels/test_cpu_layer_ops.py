"""The CPU layer ops (add + RMSNorm, SiLU-and-mul) against their twins."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_layer_ops import CpuLayerOps
from kernels.reference import rms_norm_ref, silu_and_mul_ref


@pytest.fixture(scope="module")
def ops(tmp_path_factory) -> CpuLayerOps:
    loaded = CpuLayerOps.load(tmp_path_factory.mktemp("cpu_kernels"))
    assert loaded is not None, "the CPU layer ops did not build (is gcc installed?)"
    return loaded


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32 to float32 rounding; bfloat16 to one bfloat16 step (the same float32 value may round either
    way after a different order of float32 operations)."""
    assert actual.dtype == expected.dtype
    tol = 2 ** -7 if actual.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("hidden", [576, 100])                  # SmolLM2's; one that is not a multiple of 8
@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_ref(ops, rows, hidden, x_dtype, out_dtype, with_residual):
    g = torch.Generator().manual_seed(rows * hidden)
    wide = torch.randn(rows, hidden + 64, generator=g).to(x_dtype)
    x = wide[:, 32:32 + hidden]                                     # strided rows, as a projection slice
    weight = torch.randn(hidden, generator=g)
    residual = torch.randn(rows, hidden, generator=g) if with_residual else None
    if with_residual:
        ref_out, ref_sum = rms_norm_ref(x.float(), weight, 1e-5, residual.clone())
    else:
        ref_out, ref_sum = rms_norm_ref(x.float(), weight, 1e-5), None
    out = ops.add_rms_norm(x, weight, 1e-5, residual, out_dtype=out_dtype, num_threads=2)
    _close(out, ref_out.to(out_dtype))
    if with_residual:
        torch.testing.assert_close(residual, ref_sum, rtol=0, atol=0)      # written back: x + residual


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("d", [1536, 13])
@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)])
def test_silu_mul_matches_ref(ops, rows, d, x_dtype, out_dtype):
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(rows, 2 * d, generator=g) * 6).to(x_dtype)      # gates far into both tails
    x[0, 0], x[-1, 1] = 100.0, -100.0
    out = ops.silu_mul(x, out_dtype=out_dtype, num_threads=2)
    _close(out, silu_and_mul_ref(x.float()).to(out_dtype))


def test_checks_arguments(ops):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight"):
        ops.add_rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        ops.add_rms_norm(x, torch.ones(8), 1e-5, residual=torch.zeros(2, 8).bfloat16())
    with pytest.raises(ValueError, match="x: dtype"):
        ops.silu_mul(x.half())
    with pytest.raises(ValueError, match="gate | up"):
        ops.silu_mul(torch.randn(2, 7))
