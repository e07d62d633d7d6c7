"""kernels/quick_gelu.py: the Triton QuickGELU against its torch twin and against the CPU path's torch ops
(encoders.vit, bit-exact to transformers), over dtypes and sizes that leave a partial block; CPU tensors run
through the interpreter."""

from __future__ import annotations

import pytest
import torch

from encoders.vit import quick_gelu_torch
from kernels.quick_gelu import QUICK_GELU_BLOCK, quick_gelu, quick_gelu_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (3, 5, 7), (2, QUICK_GELU_BLOCK + 3)])
def test_quick_gelu_equals_its_twin(dtype, shape):
    x = (3 * torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))).to(dtype).to(DEVICE)
    got = quick_gelu(x)
    assert got.shape == x.shape and got.dtype == dtype
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got, quick_gelu_ref(x), atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), quick_gelu_torch(x.float()), atol=tol, rtol=tol)


def test_quick_gelu_checks_its_input():
    with pytest.raises(ValueError):
        quick_gelu(torch.randn(4, 6, device=DEVICE).t())                # not contiguous
    with pytest.raises(ValueError):
        quick_gelu(torch.arange(4, device=DEVICE))                       # not a float tensor
    assert quick_gelu(torch.empty(0, 8, device=DEVICE)).shape == (0, 8)
