"""QuickGELU (CLIP's and Qwen2-VL's vision MLP activation) as one elementwise launch on the CUDA path.

torch computes ``x * sigmoid(1.702 * x)`` as three kernels, each reading and writing the whole [tokens,
intermediate] activation; this one reads it once and writes once. The math is float32 (torch rounds the
two intermediates to the activation dtype, so bf16 results may differ by one rounding);
``quick_gelu_ref`` is the pure-torch twin, and the CPU path keeps torch's ops (``encoders.vit``), which
are bit-exact to transformers. ``tests/kernels/test_kernel_quick_gelu.py`` compares the two.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from kernels.utils import FLOAT_DTYPES, check_tensor

QUICK_GELU_BLOCK = 2048
"""Elements per program."""


@triton.jit
def _quick_gelu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Semantics, program i covers flat elements [i * BLOCK, (i + 1) * BLOCK) of x (contiguous, n elements):

        out[e] = dtype(x[e] * sigmoid(1.702 * x[e]))      (float32 math)
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x / (1.0 + tl.exp(-1.702 * x))
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x: any shape, contiguous, float32 / float16 / bfloat16 -> x * sigmoid(1.702 * x), same shape and dtype
    (a new tensor)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, contiguous=True)
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        grid = (triton.cdiv(n, QUICK_GELU_BLOCK),)
        _quick_gelu_kernel[grid](x, out, n, BLOCK=QUICK_GELU_BLOCK, num_warps=8)
    return out


def quick_gelu_ref(x: torch.Tensor) -> torch.Tensor:
    """The pure-torch twin of ``quick_gelu``: float32 math, cast to x's dtype."""
    xf = x.float()
    return (xf * torch.sigmoid(1.702 * xf)).to(x.dtype)
