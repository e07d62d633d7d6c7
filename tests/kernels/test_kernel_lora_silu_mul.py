"""``kernels.lora_expand_silu_mul`` (the LoRA expand fused into SiLU-and-mul) against its torch twin.

Parametrized over every pair of dtype, rank, adapter popularity and base-model rows, token counts that cross
tile edges, odd widths, split-K partials, exact and fixed grids (the CUDA-graph launch), explicit
tile sizes; plus base-only and no-LoRA steps (plain SiLU-and-mul) and the wrapper's checks. CPU
tensors run through the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch

from kernels.lora_expand import LoRAExpandConfig
from kernels.lora_expand_silu_mul import lora_expand_silu_mul
from kernels.lora_meta import NO_LORA, build_lora_kernel_meta
from kernels.reference import lora_expand_ref, lora_expand_silu_mul_ref
from tests.kernels.test_kernel_lora import (DEVICE, POPULARITY, SLOT_CASE_IDS, SLOT_CASES, Y_TOL, make_slots,
                                           randn, slot_case_sizes)
from tests.kernels.pairwise import pairwise

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def run_case(dtype, rank, popularity, with_base, num_tokens, max_loras, d, seed, fixed_grid=False,
             split_k=1, config=None):
    g = torch.Generator().manual_seed(seed)
    slots = make_slots(num_tokens, max_loras, popularity, with_base, seed)
    meta = build_lora_kernel_meta(slots, max_loras, fixed_grid=fixed_grid)
    buf = randn(g, 2, split_k, num_tokens, rank) / split_k                          # [2, split, T, R] f32
    lora_b = [randn(g, max_loras, d, rank).to(dtype) for _ in range(2)]            # gate, up
    y = (randn(g, num_tokens, 2 * d) * 2).to(dtype)                                # [T, 2d] gate | up
    y_before = y.clone()
    out = lora_expand_silu_mul(buf, lora_b, meta, y, config=config)
    want = lora_expand_silu_mul_ref(buf, lora_b, slots, y)
    assert out.shape == (num_tokens, d) and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=Y_TOL[dtype], rtol=Y_TOL[dtype])
    else:
        # gate and up are rounded to dtype before the product: a delta summed in another order
        # may round one ulp apart, which moves out by up to ~eps * |gate * up| (and eps * |up|).
        # On CUDA h is rounded to dtype for the native dot: an error up to ~eps/2 * (|h| @ |B|.T)
        # in gate and in up.
        gu = lora_expand_ref(buf, lora_b, slots, y.float(), [0, d])                  # [T, 2d] fp32
        eps = torch.finfo(dtype).eps
        bound = 4 * eps * ((gu[:, :d] * gu[:, d:]).abs() + gu[:, d:].abs() + 1)
        if DEVICE.type == "cuda":
            mag = lora_expand_ref(buf.abs(), [b.abs() for b in lora_b], slots, torch.zeros_like(gu), [0, d])
            bound += eps * (mag[:, :d] * (gu[:, d:].abs() + 1) + mag[:, d:] * (gu[:, :d].abs() + 1))
        excess = (out.float() - want.float()).abs() - bound
        assert excess.max() <= 0, f"max error beyond the bound by {excess.max():.3g}"
    assert torch.equal(y, y_before)                                                 # y is only read
    return slots, out, want


@pytest.mark.parametrize("dtype,rank,popularity,with_base", SLOT_CASES, ids=SLOT_CASE_IDS)
def test_matches_ref(dtype, rank, popularity, with_base):
    i = SLOT_CASES.index((dtype, rank, popularity, with_base))
    num_tokens, max_loras = slot_case_sizes(i)
    run_case(dtype, rank, popularity, with_base, num_tokens, max_loras, d=(24, 37, 50)[(i // 2) % 3],
             seed=i, split_k=(1, 2, 8)[(i // 5) % 3])


@pytest.mark.parametrize("dtype,popularity,with_base", pairwise([torch.bfloat16, torch.float32], POPULARITY,
                                                                [False, True]))
def test_fixed_grid_matches_ref(dtype, popularity, with_base):
    """The CUDA-graph launch: every slot's segment programs plus the base tiles; padding exits."""
    seed = 7 + POPULARITY.index(popularity) * 2 + with_base
    run_case(dtype, 16, popularity, with_base, 20 + seed % 5, 5, d=40, seed=seed, fixed_grid=True, split_k=2)


@pytest.mark.parametrize("block_m,block_n,n_tiles", [(16, 16, 1), (32, 16, 2), (64, 32, 1)])
def test_explicit_configs(block_m, block_n, n_tiles):
    """Tiles smaller and larger than the segments; a program walking several column tiles."""
    cfg = LoRAExpandConfig(block_m=block_m, block_n=block_n, n_tiles=n_tiles, num_warps=4, num_stages=1)
    run_case(torch.float32, 8, "zipf", True, 45, 4, d=70, seed=block_m + n_tiles, config=cfg)


TOKEN_CASES = pairwise(DTYPES, POPULARITY, [False, True])


@pytest.mark.parametrize("dtype,popularity,with_base", TOKEN_CASES,
                         ids=[f"{str(d).removeprefix('torch.')}-{p}-{'base' if b else 'nobase'}"
                              for d, p, b in TOKEN_CASES])
def test_per_token_matches_ref(dtype, popularity, with_base):
    """The per-token programs (LoRAExpandConfig.per_token): ranks, widths, partial counts, column
    splits, exact and fixed-grid meta."""
    i = TOKEN_CASES.index((dtype, popularity, with_base))
    cfg = LoRAExpandConfig(block_n=16, n_tiles=(1, 2, 4)[i % 3], per_token=1)
    run_case(dtype, (1, 8, 16)[i % 3], popularity, with_base, (1, 7, 33)[(i // 2) % 3], 4, d=(24, 37, 50)[i % 3],
             seed=200 + i, fixed_grid=bool(i % 2), split_k=(1, 2, 8)[(i // 3) % 3], config=cfg)


def test_high_rank_per_token_tiles():
    """Rank 64 with the decode per-token config (512 x 2 columns, 2 warps): the programs walk
    128-column tiles (``token_block_n``) over the same 1024 columns; same result as the twin."""
    from kernels.lora_expand import token_block_n

    assert token_block_n(512, 16, 2) == 512 and token_block_n(256, 16, 4) == 256       # rank 16: as measured
    assert token_block_n(512, 64, 2) == 128 and token_block_n(512, 128, 8) == 256 and token_block_n(64, 512, 1) == 16
    run_case(torch.float32, 64, "distinct", True, 5, 4, d=1100, seed=7, fixed_grid=True,
             config=LoRAExpandConfig(16, 512, 2, 2, 2, per_token=1))


@pytest.mark.parametrize("per_token", [0, 1])
@pytest.mark.parametrize("fixed_grid", [False, True], ids=["exact", "fixed_grid"])
def test_base_rows_are_plain_silu_mul(fixed_grid, per_token):
    """Steps with no adapter row (a base-only step, and a graph step whose slots are all idle):
    out is SiLU-and-mul of y, bit for bit as the twin."""
    g = torch.Generator().manual_seed(3)
    slots = torch.full((9,), NO_LORA, dtype=torch.int32, device=DEVICE)
    meta = build_lora_kernel_meta(slots, 4, fixed_grid=fixed_grid)
    buf = torch.full((2, 1, 9, 8), float("nan"), device=DEVICE)                   # never read
    lora_b = [torch.full((4, 24, 8), float("nan"), device=DEVICE) for _ in range(2)]
    y = randn(g, 9, 48)
    out = lora_expand_silu_mul(buf, lora_b, meta, y,
                               config=LoRAExpandConfig(block_n=16, per_token=1) if per_token else None)
    d = 24
    want = (torch.nn.functional.silu(y[:, :d]) * y[:, d:])
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def test_rejects_bad_inputs():
    slots = torch.tensor([0, 1, NO_LORA], dtype=torch.int32, device=DEVICE)
    meta = build_lora_kernel_meta(slots, 2)
    buf = torch.zeros(2, 1, 3, 8, device=DEVICE)
    lora_b = [torch.zeros(2, 16, 8, device=DEVICE) for _ in range(2)]
    y = torch.zeros(3, 32, device=DEVICE)
    with pytest.raises(ValueError, match="must be even"):
        lora_expand_silu_mul(buf, lora_b, meta, torch.zeros(3, 31, device=DEVICE))
    with pytest.raises(ValueError, match=r"expected \(B_gate, B_up\)"):
        lora_expand_silu_mul(buf, lora_b[:1], meta, y)
    with pytest.raises(ValueError, match=r"widths \(16, 16\), expected \(24, 24\)"):
        lora_expand_silu_mul(buf, lora_b, meta, torch.zeros(3, 48, device=DEVICE))
    with pytest.raises(ValueError, match="buf"):
        lora_expand_silu_mul(torch.zeros(3, 1, 3, 8, device=DEVICE), lora_b, meta, y)
    with pytest.raises(ValueError, match="out"):
        lora_expand_silu_mul(buf, lora_b, meta, y, out=torch.zeros(3, 15, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,max_loras,popularity,fixed_grid",
                         [(64, 64, "distinct", True), (64, 64, "zipf", True), (256, 16, "zipf", False),
                          (4096, 8, "uniform", False)])
def test_gpu_real_sizes(dtype, num_tokens, max_loras, popularity, fixed_grid):
    """Llama-3-8B's MLP width (d = 14336), rank 16, decode and prefill sizes."""
    for cfg in (None, LoRAExpandConfig(block_n=128, n_tiles=4, per_token=1)):
        run_case(dtype, 16, popularity, True, num_tokens, max_loras, d=14336, seed=num_tokens,
                 fixed_grid=fixed_grid, split_k=4, config=cfg)


@pytest.mark.parametrize("dtype,per_token,fixed_grid", pairwise(DTYPES, [0, 1], [False, True]))
def test_reads_every_slots_shrink(dtype, per_token, fixed_grid):
    """With slot_stride (``slotwise_buf`` over a GEMM-shaped output holding every slot's h) the
    output is bit-identical to the launch on each token's own h, base rows included."""
    from kernels.lora_expand import slotwise_buf

    num_tokens, max_loras, rank, d = 9, 4, 8, 48
    g = torch.Generator().manual_seed(11 + per_token)
    slots = make_slots(num_tokens, max_loras, "uniform", True, 11)
    meta = build_lora_kernel_meta(slots, max_loras, fixed_grid=fixed_grid)
    wide = randn(g, num_tokens, 3 + max_loras * 2 * rank).to(dtype)                 # [T, 3 | L*2*R]
    h_all = wide[:, 3:].view(num_tokens, max_loras, 2, rank)
    buf, slot_stride = slotwise_buf(h_all)
    own = torch.zeros(2, 1, num_tokens, rank, device=DEVICE)
    for t, slot in enumerate(slots.tolist()):
        if slot != NO_LORA:
            own[:, 0, t] = h_all[t, slot].float()
    lora_b = [randn(g, max_loras, d, rank).to(dtype) for _ in range(2)]
    y = (randn(g, num_tokens, 2 * d) * 2).to(dtype)
    cfg = LoRAExpandConfig(block_n=16, n_tiles=2, per_token=per_token)
    got = lora_expand_silu_mul(buf, lora_b, meta, y, config=cfg, slot_stride=slot_stride)
    want = lora_expand_silu_mul(own, lora_b, meta, y, config=cfg)
    assert torch.equal(got, want)
