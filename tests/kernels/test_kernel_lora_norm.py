"""``kernels.lora_expand_norm`` (the LoRA expand fused into add + RMSNorm) against its torch twin.

Parametrized over dtype x rank x adapter popularity x base-model rows x with / without residual,
odd hidden sizes (one and several chunks) and split-K partials; plus the in-place stores, a
base-only step and the wrapper's checks. CPU tensors run through the Triton interpreter.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.lora_expand_norm import lora_expand_add_rms_norm
from kernels.lora_meta import NO_LORA, build_lora_kernel_meta
from kernels.reference import lora_expand_add_rms_norm_ref, lora_expand_ref
from tests.kernels.test_kernel_lora import DEVICE, POPULARITY, make_slots, randn

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def run_case(dtype, rank, popularity, with_base, has_residual, num_tokens, hidden, max_loras, split_k, seed):
    g = torch.Generator().manual_seed(seed)
    slots = make_slots(num_tokens, max_loras, popularity, with_base, seed)
    meta = build_lora_kernel_meta(slots, max_loras)
    buf = randn(g, 1, split_k, num_tokens, rank) / split_k                          # [1, split, T, R]
    lora_b = (randn(g, max_loras, hidden, rank) * 0.3).to(dtype)
    x = randn(g, num_tokens, hidden).to(dtype)
    residual = randn(g, num_tokens, hidden).to(dtype) if has_residual else None
    weight = (1 + 0.1 * randn(g, hidden)).to(dtype)
    want, want_s = lora_expand_add_rms_norm_ref(buf, lora_b, slots, x, weight, 1e-5, residual)
    x_in, res_in = x.clone(), None if residual is None else residual.clone()
    out = lora_expand_add_rms_norm(buf, lora_b, meta, x_in, weight, 1e-5, res_in)
    s = res_in if has_residual else x_in                                            # the sum, stored in place
    eps = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-6
    # One rounding of p or s may land an ulp apart (h rounded to dtype on CUDA, sums in another
    # order): s within 2 ulps of the sum, out within a few ulps of its scale.
    p_mag = lora_expand_ref(buf.abs(), [lora_b.abs()], slots, x.abs(), [0]).float()
    s_bound = 2 * eps * (p_mag + (0 if residual is None else residual.float().abs())) + 1e-6
    assert ((s.float() - want_s.float()).abs() <= s_bound).all()
    torch.testing.assert_close(out.float(), want.float(), atol=8 * eps, rtol=8 * eps)
    return slots, out


CASES = list(itertools.product(DTYPES, [4, 16], POPULARITY, [False, True], [True, False]))


@pytest.mark.parametrize("dtype,rank,popularity,with_base,has_residual", CASES,
                         ids=[f"{str(d).removeprefix('torch.')}-r{r}-{p}-{'base' if b else 'nobase'}-"
                              f"{'res' if h else 'nores'}" for d, r, p, b, h in CASES])
def test_matches_ref(dtype, rank, popularity, with_base, has_residual):
    i = CASES.index((dtype, rank, popularity, with_base, has_residual))
    run_case(dtype, rank, popularity, with_base, has_residual, num_tokens=(1, 7, 20)[i % 3],
             hidden=(40, 72, 1100)[(i // 3) % 3], max_loras=(1, 3, 4)[(i // 2) % 3] if i % 3 else 4,
             split_k=(1, 2, 8)[(i // 5) % 3], seed=i)


def test_base_rows_are_plain_add_rms_norm():
    """A step without adapter rows: exactly ``add_rms_norm`` (B and the partials never read)."""
    from kernels.layer_ops import add_rms_norm

    g = torch.Generator().manual_seed(4)
    slots = torch.full((5,), NO_LORA, dtype=torch.int32, device=DEVICE)
    meta = build_lora_kernel_meta(slots, 2, fixed_grid=True)
    buf = torch.full((1, 1, 5, 8), float("nan"), device=DEVICE)
    lora_b = torch.full((2, 48, 8), float("nan"), device=DEVICE)
    x, residual, weight = randn(g, 5, 48), randn(g, 5, 48), randn(g, 48)
    r1, r2 = residual.clone(), residual.clone()
    out = lora_expand_add_rms_norm(buf, lora_b, meta, x.clone(), weight, 1e-6, r1)
    want = add_rms_norm(x.clone(), weight, 1e-6, residual=r2)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(r1, r2, atol=1e-6, rtol=1e-6)


def test_rejects_bad_inputs():
    slots = torch.tensor([0, NO_LORA], dtype=torch.int32, device=DEVICE)
    meta = build_lora_kernel_meta(slots, 2)
    buf = torch.zeros(1, 1, 2, 8, device=DEVICE)
    lora_b = torch.zeros(2, 16, 8, device=DEVICE)
    x, w = torch.zeros(2, 16, device=DEVICE), torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="buf"):
        lora_expand_add_rms_norm(torch.zeros(2, 1, 2, 8, device=DEVICE), lora_b, meta, x, w, 1e-6)
    with pytest.raises(ValueError, match="lora_b"):
        lora_expand_add_rms_norm(buf, torch.zeros(2, 15, 8, device=DEVICE), meta, x, w, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        lora_expand_add_rms_norm(buf, lora_b, meta, x, w, 1e-6, residual=torch.zeros(2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="weight"):
        lora_expand_add_rms_norm(buf, lora_b, meta, x, torch.ones(15, device=DEVICE), 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,max_loras,popularity", [(64, 64, "distinct"), (64, 16, "zipf"),
                                                              (256, 16, "uniform")])
def test_gpu_real_sizes(dtype, num_tokens, max_loras, popularity):
    """Llama-3-8B's hidden size (4096), rank 16, decode sizes, with base rows and a residual."""
    run_case(dtype, 16, popularity, True, True, num_tokens, 4096, max_loras, 4, seed=num_tokens + max_loras)
