"""``kernels.gemm_lora`` (GEMM with the LoRA shrink and expand in one launch) against its torch twin.

Parametrized over dtype x rank x adapter popularity x base-model rows, packed slices (q/k/v-like,
one odd slice, gate/up-like), token counts that cross tile edges, exact and fixed grids (the
CUDA-graph launch), several shrink-program counts and epilogue chunk sizes, a bias; plus
repeated launches on one sync buffer (the kernel must leave it zeroed) and the wrapper's checks.
CPU tensors run through the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on
CUDA the ``gpu`` cases run at Llama-3-8B decode sizes.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from kernels.gemm_lora import GemmLoRAConfig, gemm_lora, gemm_lora_config
from kernels.lora_meta import build_lora_kernel_meta
from kernels.reference import gemm_lora_ref
from tests.kernels.test_kernel_lora import (DEVICE, POPULARITY, SLOT_CASE_IDS, SLOT_CASES, make_slots, randn,
                                           slot_case_sizes)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SHAPES = [(40, (48, 16, 16)), (37, (33,)), (48, (40, 40))]
"""(in_dim, widths of the packed slices): q/k/v-like, one odd slice, gate/up-like with an in_dim
that the interpreter's 16-wide K steps divide (the kernels' unmasked EVEN_K loops)."""


def scratch(num_tokens: int, device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((max(num_tokens, 1), 64), float("nan"), dtype=torch.float32, device=device),
            torch.zeros(2, dtype=torch.int32, device=device))


def run_case(dtype, rank, popularity, with_base, num_tokens, max_loras, in_dim, widths, seed,
             fixed_grid=False, bias=False, config=None, sync=None):
    g = torch.Generator().manual_seed(seed)
    slots = make_slots(num_tokens, max_loras, popularity, with_base, seed)
    meta = build_lora_kernel_meta(slots, max_loras, fixed_grid=fixed_grid)
    x = randn(g, num_tokens, in_dim).to(dtype)                                         # [T, K]
    w = (randn(g, sum(widths), in_dim) / in_dim ** 0.5).to(dtype)                       # [N, K]
    b = randn(g, sum(widths)).to(dtype) if bias else None
    lora_a = (randn(g, len(widths), max_loras, rank, in_dim) / in_dim ** 0.5).to(dtype)   # [S, L, R, K]
    lora_b = [(randn(g, max_loras, d, rank) / rank ** 0.5).to(dtype) for d in widths]     # [L, n_s, R]
    offs = [sum(widths[:s]) for s in range(len(widths))]
    h, sync0 = scratch(num_tokens)
    sync = sync0 if sync is None else sync
    out = gemm_lora(x, w, b, lora_a, lora_b, meta, offs, h, sync, config=config)
    round_h = DEVICE.type == "cuda" and dtype != torch.float32
    want = gemm_lora_ref(x, w, b, lora_a, lora_b, slots, offs, round_h=round_h)
    assert out.shape == (num_tokens, sum(widths)) and out.dtype == dtype
    # Error bound: a few roundings of |x| @ |W|.T + |h| @ |B|.T in dtype (fp32 in the interpreter
    # up to the final rounding; tf32 never: float32 runs "ieee").
    mag = gemm_lora_ref(x.abs(), w.abs(), None if b is None else b.abs(), lora_a.abs(), [t.abs() for t in lora_b],
                        slots, offs).float()
    eps = torch.finfo(dtype).eps
    bound = (2 * eps + (1e-5 if dtype == torch.float32 else 0)) * (mag + 1) + (eps * mag if round_h else 0)
    excess = (out.float() - want.float()).abs() - bound
    assert excess.max() <= 0, f"max error beyond the bound by {excess.max():.3g}"
    assert torch.equal(sync.cpu(), torch.zeros(2, dtype=torch.int32)), "the kernel must leave sync zeroed"
    return out, want


@pytest.mark.parametrize("dtype,rank,popularity,with_base", SLOT_CASES, ids=SLOT_CASE_IDS)
def test_matches_ref(dtype, rank, popularity, with_base):
    i = SLOT_CASES.index((dtype, rank, popularity, with_base))
    num_tokens, max_loras = slot_case_sizes(i)
    in_dim, widths = SHAPES[(i // 2) % 3]
    run_case(dtype, rank, popularity, with_base, num_tokens, max_loras, in_dim, widths, seed=i)


@pytest.mark.parametrize("dtype,popularity,with_base",
                         list(itertools.product([torch.bfloat16, torch.float32], POPULARITY, [False, True])))
def test_fixed_grid_matches_ref(dtype, popularity, with_base):
    """The CUDA-graph launch: num_active = max_loras, padding entries (slot -1) skipped."""
    seed = 3 + POPULARITY.index(popularity) * 2 + with_base
    run_case(dtype, 16, popularity, with_base, 20 + seed % 5, 5, 40, (48, 16, 16), seed, fixed_grid=True)


@pytest.mark.parametrize("shrink_programs,lora_chunk,shrink_m", [(1, 1, 16), (3, 2, 16), (8, 4, 32)])
def test_launch_configs(shrink_programs, lora_chunk, shrink_m):
    """One shrink program walking every segment, more programs than segments, chunks of 1-4
    adapters per epilogue dot, shrink tiles larger than the segments."""
    cfg = dataclasses.replace(gemm_lora_config(33, DEVICE), shrink_programs=shrink_programs,
                              lora_chunk=lora_chunk, shrink_m=shrink_m)
    run_case(torch.float32, 8, "uniform", True, 33, 6, 40, (48, 16, 16), seed=11, config=cfg)


def test_bias_and_m_tiles():
    """A bias, and more rows than one M tile (two GEMM tiles per column range)."""
    cfg = dataclasses.replace(gemm_lora_config(40, DEVICE), block_m=16)
    run_case(torch.float32, 4, "zipf", True, 40, 4, 37, (33,), seed=5, bias=True, config=cfg)


def test_sync_buffer_reused():
    """Launches back to back on one sync buffer: each leaves it zeroed for the next."""
    sync = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    for seed in range(3):
        run_case(torch.float32, 8, POPULARITY[seed], seed == 1, 9 + seed, 3, 24, (40, 40), seed=20 + seed,
                 sync=sync)


def test_no_lora_rows_equal_gemm():
    """A step whose tokens all run the base model: the plain product (h is never read)."""
    g = torch.Generator().manual_seed(0)
    x, w = randn(g, 5, 24), randn(g, 40, 24)
    slots = torch.full((5,), -1, dtype=torch.int32, device=DEVICE)
    meta = build_lora_kernel_meta(slots, 2, fixed_grid=True)
    a, b = randn(g, 1, 2, 4, 24), [randn(g, 2, 40, 4)]
    h, sync = scratch(5)
    out = gemm_lora(x, w, None, a, b, meta, [0], h, sync)
    torch.testing.assert_close(out, x @ w.T, atol=1e-4, rtol=1e-4)


def test_checks():
    g = torch.Generator().manual_seed(0)
    x, w = randn(g, 4, 24), randn(g, 40, 24)
    slots = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    meta = build_lora_kernel_meta(slots, 2)
    a, b = randn(g, 2, 2, 4, 24), [randn(g, 2, 20, 4), randn(g, 2, 20, 4)]
    h, sync = scratch(4)
    with pytest.raises(ValueError, match="tile the output"):
        gemm_lora(x, w, None, a, b, meta, [0, 16], h, sync)
    with pytest.raises(ValueError, match="expected 2 tensors"):
        gemm_lora(x, w, None, a, b[:1], meta, [0], h, sync)
    with pytest.raises(ValueError, match="h: needs"):
        gemm_lora(x, w, None, a, b, meta, [0, 20], h[:, :16], sync)
    with pytest.raises(ValueError, match="sync"):
        gemm_lora(x, w, None, a, b, meta, [0, 20], h, sync.long())
    with pytest.raises(ValueError, match="weight"):
        gemm_lora(x, w[:, :20], None, a, b, meta, [0, 20], h, sync)
    with pytest.raises(ValueError, match="lora_chunk"):
        GemmLoRAConfig(lora_chunk=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("widths,in_dim", [((4096, 1024, 1024), 4096), ((4096,), 4096), ((4096,), 14336)],
                         ids=["qkv", "o", "down"])
@pytest.mark.parametrize("num_adapters", [1, 16, 64])
def test_gpu_llama_decode_sizes(widths, in_dim, num_adapters):
    """Llama-3-8B projections at a 64-token decode step, bf16, fixed grid over 64 slots."""
    run_case(torch.bfloat16, 16, "distinct" if num_adapters > 1 else "identical", True, 64, num_adapters,
             in_dim, widths, seed=num_adapters, fixed_grid=True)
