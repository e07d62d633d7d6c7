"""The column-block LoRA expand (``kernels.lora_expand_cols``) against the torch twin.

Parametrized over dtype x rank x adapter popularity (distinct, uniform, Zipf, identical) x
base-model rows, exact and fixed grid (padding entries in active_slots), 1..3 slices with odd
widths, split-K partials, one and several token tiles; plus config choice, overwrite mode,
base-only steps and bad inputs. On CPU the kernel runs under TRITON_INTERPRET=1 (conftest).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.lora_expand_cols import (EXPAND_COLS_MAX_TOKENS, LoRAExpandColsConfig, lora_expand_cols,
                                      lora_expand_cols_config)
from kernels.lora_meta import NO_LORA, build_lora_kernel_meta
from kernels.reference import lora_expand_ref
from tests.kernels.test_kernel_lora import DEVICE, POPULARITY, Y_TOL, make_slots, randn

SHAPES = [(48, 16, 16), (37,), (100, 72)]
"""Output width of each slice: packed qkv-like, one odd slice, two wide slices."""

CASES = list(itertools.product([torch.float16, torch.bfloat16, torch.float32], [1, 8, 16], POPULARITY,
                               [False, True]))
CASE_IDS = [f"{str(d).removeprefix('torch.')}-r{r}-{p}-{'base' if b else 'nobase'}" for d, r, p, b in CASES]


def run_case(dtype, rank, popularity, with_base, num_tokens, max_loras, out_dims, seed, fixed_grid=False,
             split_k=1, config=None, add_inputs=True):
    g = torch.Generator().manual_seed(seed)
    slots = make_slots(num_tokens, max_loras, popularity, with_base, seed)
    meta = build_lora_kernel_meta(slots, max_loras, fixed_grid=fixed_grid)
    num_slices = len(out_dims)
    buf = randn(g, num_slices, split_k, num_tokens, rank)                         # [S, split, T, R] f32
    lora_b = [randn(g, max_loras, n, rank).to(dtype) for n in out_dims]
    offsets = [sum(out_dims[:s]) for s in range(num_slices)]
    y = randn(g, num_tokens, sum(out_dims) + 3).to(dtype)                         # 3 spare columns
    y_ref = lora_expand_ref(buf, lora_b, slots, y, offsets, add_inputs=add_inputs)
    lora_expand_cols(buf, lora_b, meta, y, offsets, add_inputs=add_inputs, config=config)
    tol = Y_TOL[dtype] * max(1, rank ** 0.5 / 2)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
    base = slots == NO_LORA
    assert torch.equal(y[base], y_ref[base])                                      # base rows untouched
    return y


@pytest.mark.parametrize("dtype,rank,popularity,with_base", CASES, ids=CASE_IDS)
def test_matches_ref(dtype, rank, popularity, with_base):
    i = CASES.index((dtype, rank, popularity, with_base))
    num_tokens = [1, 7, 33][i % 3]
    max_loras = [1, 3, 5][(i // 3) % 3] if num_tokens > 1 else 4
    run_case(dtype, rank, popularity, with_base, num_tokens, max_loras, SHAPES[(i // 9) % 3], seed=i,
             fixed_grid=bool(i % 2), split_k=[1, 2, 8][(i // 2) % 3])


@pytest.mark.parametrize("block_t,num_tokens", [(16, 40), (16, 16), (32, 33)])
@pytest.mark.parametrize("fixed_grid", [False, True])
def test_several_token_tiles(block_t, num_tokens, fixed_grid):
    """Programs of later token tiles see the same adapter loop (each reads every active B)."""
    cfg = LoRAExpandColsConfig(block_t=block_t, block_n=16, num_warps=4, num_stages=1)
    run_case(torch.float32, 16, "uniform", True, num_tokens, 4, (48, 20), seed=num_tokens, fixed_grid=fixed_grid,
             split_k=2, config=cfg)


def test_overwrite_mode():
    y = run_case(torch.float32, 4, "zipf", True, 9, 3, (24,), seed=7, add_inputs=False)
    assert torch.isfinite(y).all()


def test_base_only_step_touches_nothing():
    slots = torch.full((6,), NO_LORA, dtype=torch.int32, device=DEVICE)
    meta = build_lora_kernel_meta(slots, 4, fixed_grid=True)                      # launches, loops 0 times
    g = torch.Generator().manual_seed(0)
    y = randn(g, 6, 40)
    y0 = y.clone()
    lora_expand_cols(randn(g, 1, 1, 6, 8), [randn(g, 4, 40, 8)], meta, y, [0])
    assert torch.equal(y, y0)


def test_default_config():
    cpu = torch.device("cpu")
    cfg = lora_expand_cols_config(7, (48, 16, 16), cpu)
    assert cfg.block_t == 16 and cfg.block_n >= 16
    assert lora_expand_cols_config(100, (64,), cpu).block_t == 128
    assert lora_expand_cols_config(7, (64,), cpu, (("block_n", 64), ("num_stages", 2))).block_n == 64
    assert EXPAND_COLS_MAX_TOKENS <= 256
    with pytest.raises(ValueError, match="block_t"):
        LoRAExpandColsConfig(block_t=512)
    with pytest.raises(ValueError, match="block_n"):
        LoRAExpandColsConfig(block_n=24)


def test_rejects_bad_inputs():
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([0, 1, NO_LORA], dtype=torch.int32, device=DEVICE)
    meta = build_lora_kernel_meta(slots, 2)
    buf, b, y = randn(g, 1, 1, 3, 8), randn(g, 2, 16, 8), randn(g, 3, 16)
    with pytest.raises(ValueError, match="buf"):
        lora_expand_cols(buf.half(), [b], meta, y, [0])
    with pytest.raises(ValueError, match="lora_b_slices"):
        lora_expand_cols(buf, [b[:, :, :4].contiguous()], meta, y, [0])
    with pytest.raises(ValueError, match="slice_offsets"):
        lora_expand_cols(buf, [b], meta, y, [4])
    with pytest.raises(ValueError, match="meta"):
        lora_expand_cols(buf[:, :, :2].contiguous(), [b], meta, y[:2], [0])
    with pytest.raises(ValueError, match="lora_b_slices"):
        lora_expand_cols(buf, [b] * 4, meta, y, [0] * 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,max_loras,popularity,out_dims", [
    (64, 64, "distinct", (4096, 1024, 1024)), (64, 16, "zipf", (14336, 14336)), (128, 4, "identical", (4096,)),
    (1, 4, "uniform", (4096,)), (256, 64, "uniform", (4096, 1024, 1024))])
def test_gpu_real_sizes(dtype, num_tokens, max_loras, popularity, out_dims):
    """Llama-3-8B projections, rank 16, default configs, fixed grid (the CUDA-graph launch)."""
    g = torch.Generator().manual_seed(0)
    slots = make_slots(num_tokens, max_loras, popularity, True, seed=1)
    meta = build_lora_kernel_meta(slots, max_loras, fixed_grid=True)
    buf = randn(g, len(out_dims), 8, num_tokens, 16) / 8
    lora_b = [(randn(g, max_loras, n, 16) / 4).to(dtype) for n in out_dims]
    offsets = [sum(out_dims[:s]) for s in range(len(out_dims))]
    y = randn(g, num_tokens, sum(out_dims)).to(dtype)
    y_ref = lora_expand_ref(buf, lora_b, slots, y, offsets)
    lora_expand_cols(buf, lora_b, meta, y, offsets)
    tol = 2 * Y_TOL[dtype]
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
