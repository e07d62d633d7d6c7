"""The fused LoRA kernel (shrink + expand in one launch) against its torch twin and the split pair.

Parametrized over dtype x adapter popularity (distinct, uniform, Zipf, identical) x base-model
rows, with ranks 1..16 (one zero-padded below the slots' rank), 1..3 slices of different widths
at offsets with gaps, odd input dims, 1..33 tokens, 1..4 slots, exact and fixed grid; plus
explicit launch configs, the CUDA default configs and the wrapper's argument checks.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.lora_expand import lora_expand
from kernels.lora_fused import (FUSED_MAX_TOKENS, LoRAFusedConfig, lora_fused_config,
                                lora_shrink_expand)
from kernels.lora_meta import NO_LORA, build_lora_kernel_meta
from kernels.lora_shrink import lora_shrink, lora_shrink_config, parse_config_override
from kernels.reference import lora_shrink_expand_ref
from tests.kernels.test_kernel_lora import DEVICE, DTYPES, POPULARITY, Y_TOL, make_slots, randn

RANKS = [(16, 16), (16, 5), (8, 8), (1, 1)]
"""(rank of the slot tensors, rank the adapters use): (16, 5) is an adapter zero-padded below the
slots' rank, as ``lora.layers`` stores one."""
SHAPES = [(72, (48, 16, 24)), (100, (37,)), (37, (100, 72))]
"""(in_dim, out_dim of each slice): packed qkv-like with three widths, one odd slice, two wide slices."""
SHAPE_IDS = ["qkv", "odd", "wide"]
NUM_TOKENS = [1, 7, 33]
MAX_LORAS = [1, 3, 4]


def layout(out_dims: tuple[int, ...]) -> tuple[list[int], int]:
    """(slice offsets, y width): 2 spare columns first, one between slices, 3 after the last."""
    offsets, col = [], 2
    for n in out_dims:
        offsets.append(col)
        col += n + 1
    return offsets, col + 2


def run_case(dtype, rank, used_rank, popularity, with_base, num_tokens, max_loras, shape, seed,
             fixed_grid=False, config=None):
    """Fused vs the twin and vs lora_shrink + lora_expand; rows and columns outside the update untouched."""
    in_dim, out_dims = shape
    g = torch.Generator().manual_seed(seed)
    slots = make_slots(num_tokens, max_loras, popularity, with_base, seed)
    meta = build_lora_kernel_meta(slots, max_loras, fixed_grid=fixed_grid)
    num_slices = len(out_dims)
    x = randn(g, num_tokens, in_dim).to(dtype)                                        # [T, in_dim]
    lora_a = randn(g, num_slices, max_loras, rank, in_dim) / in_dim ** 0.5          # [S, L, R, in_dim]
    lora_b = [randn(g, max_loras, n, rank) for n in out_dims]                        # [L, n_s, R]
    lora_a[:, :, used_rank:] = 0                                                     # zero-padded rank
    for b in lora_b:
        b[:, :, used_rank:] = 0
    lora_a, lora_b = lora_a.to(dtype), [b.to(dtype) for b in lora_b]
    offsets, width = layout(out_dims)
    y0 = randn(g, num_tokens, width).to(dtype)                                       # [T, width]

    y = y0.clone()
    lora_shrink_expand(x, lora_a, lora_b, meta, y, offsets, config=config)
    y_ref = lora_shrink_expand_ref(x, lora_a, lora_b, slots, y0, offsets)
    tol = Y_TOL[dtype]
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)

    split_k = lora_shrink_config(num_tokens, meta.num_active, num_slices, in_dim, DEVICE).split_k
    buf = torch.empty(num_slices, split_k, num_tokens, rank, device=DEVICE)          # [S, split, T, R]
    y_split = y0.clone()
    lora_shrink(x, lora_a, meta, buf)
    lora_expand(buf, lora_b, meta, y_split, offsets)
    torch.testing.assert_close(y.float(), y_split.float(), atol=tol, rtol=tol)

    base = slots == NO_LORA
    assert torch.equal(y[base], y0[base])                                            # base rows untouched
    inside = torch.zeros(width, dtype=torch.bool)
    for off, n in zip(offsets, out_dims):
        inside[off:off + n] = True
    assert torch.equal(y[:, ~inside.to(y.device)], y0[:, ~inside.to(y.device)])     # spare columns untouched
    return slots, y, y_ref


CASES = list(itertools.product(DTYPES, POPULARITY, [False, True]))
CASE_IDS = [f"{str(d).removeprefix('torch.')}-{p}-{'base' if b else 'nobase'}" for d, p, b in CASES]


@pytest.mark.parametrize("dtype,popularity,with_base", CASES, ids=CASE_IDS)
def test_fused_matches_ref_and_split(dtype, popularity, with_base):
    i = CASES.index((dtype, popularity, with_base))
    # Sizes, ranks and the grid rotate with the case index so each meets every dtype.
    num_tokens = NUM_TOKENS[i % 3]
    max_loras = MAX_LORAS[(i // 3) % 3] if num_tokens > 1 else 4
    rank, used = RANKS[i % 4]
    run_case(dtype, rank, used, popularity, with_base, num_tokens, max_loras, SHAPES[(i // 2) % 3], seed=i,
             fixed_grid=i % 2 == 1)


@pytest.mark.parametrize("rank,used_rank", RANKS, ids=[f"r{r}-uses{u}" for r, u in RANKS])
@pytest.mark.parametrize("fixed_grid", [False, True], ids=["exact", "fixed_grid"])
def test_ranks(rank, used_rank, fixed_grid):
    run_case(torch.bfloat16, rank, used_rank, "zipf", True, 33, 4, SHAPES[0], seed=rank * 10 + used_rank,
             fixed_grid=fixed_grid)


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_sizes(num_tokens, shape):
    run_case(torch.float16, 8, 8, "uniform", True, num_tokens, 3, shape, seed=num_tokens)


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("fixed_grid", [False, True], ids=["exact", "fixed_grid"])
def test_explicit_configs(block_m, fixed_grid):
    """Tiles of every size, one or several input chunks, programs walking 1..4 column tiles."""
    for i, (block_k, block_n, n_tiles) in enumerate([(16, 16, 1), (128, 16, 4), (32, 32, 2)]):
        cfg = LoRAFusedConfig(block_m=block_m, block_k=block_k, block_n=block_n, n_tiles=n_tiles,
                              num_warps=8 if i else 4, num_stages=2)
        run_case(torch.float32, 8, 8, POPULARITY[(i + block_m // 32) % 4], True, 70, 3, SHAPES[i],
                 seed=block_m + i, fixed_grid=fixed_grid, config=cfg)


def test_fixed_grid_base_only_touches_nothing():
    """A graph step with no adapter still launches; every program exits, y is unchanged."""
    slots = torch.full((9,), NO_LORA, dtype=torch.int32, device=DEVICE)
    meta = build_lora_kernel_meta(slots, 4, fixed_grid=True)
    assert not meta.no_lora and meta.num_active == 4
    y = torch.randn(9, 24, device=DEVICE)
    y0 = y.clone()
    lora_shrink_expand(torch.randn(9, 40, device=DEVICE), torch.randn(1, 4, 8, 40, device=DEVICE),
                       [torch.randn(4, 24, 8, device=DEVICE)], meta, y, [0])
    assert torch.equal(y, y0)


def test_no_lora_touches_nothing():
    slots = torch.full((5,), NO_LORA, dtype=torch.int32, device=DEVICE)
    meta = build_lora_kernel_meta(slots, 4)
    assert meta.no_lora
    y = torch.randn(5, 16, device=DEVICE)
    y0 = y.clone()
    lora_shrink_expand(torch.randn(5, 16, device=DEVICE), torch.randn(1, 4, 8, 16, device=DEVICE),
                       [torch.randn(4, 16, 8, device=DEVICE)], meta, y, [0])
    assert torch.equal(y, y0)


@pytest.fixture
def h200_sms(monkeypatch):
    """Plan configs for a 132-SM GPU without one (the config function is cached: cleared)."""
    import kernels.lora_expand as ke
    import kernels.lora_fused as kf

    monkeypatch.setattr(ke, "num_sms", lambda device: 132)   # widest_n_tiles reads it there
    kf.lora_fused_config.cache_clear()
    yield 132
    kf.lora_fused_config.cache_clear()


def test_default_configs(h200_sms):
    """Decode, fixed grid (every slot a segment): the most columns per program that leave 2 programs
    with work per SM; overrides win; the interpreter gets small tiles."""
    cuda = torch.device("cuda", 0)
    layers = [(4096, (4096, 1024, 1024)), (4096, (4096,)), (4096, (14336, 14336)), (14336, (4096,))]
    for num_tokens in (1, 64, 256):
        for segments in (1, 16, 64):
            for in_dim, outs in layers:
                cfg = lora_fused_config(num_tokens, segments, in_dim, outs, cuda)
                assert (cfg.block_k, cfg.block_n, cfg.num_warps, cfg.num_stages) == (256, 128, 4, 3)
                tiles = min(segments, num_tokens) + (num_tokens - min(segments, num_tokens)) // cfg.block_m

                def programs(n_tiles, outs=outs, tiles=tiles):
                    return tiles * sum(-(-n // (128 * n_tiles)) for n in outs)
                assert cfg.n_tiles == 1 or programs(cfg.n_tiles) >= 2 * h200_sms, (cfg, outs)
                assert cfg.n_tiles == 32 or programs(2 * cfg.n_tiles) < 2 * h200_sms, (cfg, outs)
    assert lora_fused_config(64, 16, 4096, (4096, 1024, 1024), cuda).n_tiles == 2
    assert lora_fused_config(64, 64, 4096, (4096,), cuda, (("n_tiles", 8), ("block_k", 128))) == \
        LoRAFusedConfig(16, 128, 128, 8, 4, 3)
    cpu = lora_fused_config(7, 3, 100, (37,), torch.device("cpu"))
    assert (cpu.block_m, cpu.block_k, cpu.block_n) == (16, 32, 32)
    assert FUSED_MAX_TOKENS >= 64


def test_config_validates():
    assert parse_config_override("block_k=64, n_tiles=4,num_stages=2", LoRAFusedConfig) == (
        ("block_k", 64), ("n_tiles", 4), ("num_stages", 2))
    for bad in ("block_m=8", "block_k=48", "block_n=0", "n_tiles=64", "num_warps=3", "num_stages=0"):
        with pytest.raises(ValueError, match=bad.partition("=")[0]):
            parse_config_override(bad, LoRAFusedConfig)
    with pytest.raises(ValueError, match="field in"):
        parse_config_override("split_k=2", LoRAFusedConfig)


def test_rejects_bad_inputs():
    slots = torch.tensor([0, 1, NO_LORA], dtype=torch.int32, device=DEVICE)
    meta = build_lora_kernel_meta(slots, 2)
    x, a = torch.randn(3, 16, device=DEVICE), torch.randn(1, 2, 4, 16, device=DEVICE)
    b, y = [torch.randn(2, 8, 4, device=DEVICE)], torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="x: expected 2 dims"):
        lora_shrink_expand(x[None], a, b, meta, y, [0])
    with pytest.raises(ValueError, match="x: dtype"):
        lora_shrink_expand(x.double(), a, b, meta, y, [0])
    with pytest.raises(ValueError, match="x: last dim must have stride 1"):
        lora_shrink_expand(torch.randn(16, 3, device=DEVICE).t(), a, b, meta, y, [0])
    with pytest.raises(ValueError, match="y: expected shape"):
        lora_shrink_expand(x, a, b, meta, y[:2], [0])
    with pytest.raises(ValueError, match="lora_a: dtype"):
        lora_shrink_expand(x, a.half(), b, meta, y, [0])
    with pytest.raises(ValueError, match="lora_a: expected shape"):
        lora_shrink_expand(x, torch.randn(1, 2, 4, 8, device=DEVICE), b, meta, y, [0])
    with pytest.raises(ValueError, match="lora_a: expected shape"):
        lora_shrink_expand(x, a, b + b, meta, torch.randn(3, 16, device=DEVICE), [0, 8])  # 2 B, 1 A slice
    with pytest.raises(ValueError, match="1..3 tensors"):
        lora_shrink_expand(x, a.expand(4, 2, 4, 16).contiguous(), b * 4, meta,
                           torch.randn(3, 32, device=DEVICE), [0, 8, 16, 24])
    with pytest.raises(ValueError, match="1..3 tensors"):
        lora_shrink_expand(x, a, b[0], meta, y, [0])
    with pytest.raises(ValueError, match=r"lora_b_slices\[0\]: dtype"):
        lora_shrink_expand(x, a, [b[0].half()], meta, y, [0])
    with pytest.raises(ValueError, match=r"lora_b_slices\[0\]: expected shape"):
        lora_shrink_expand(x, a, [torch.randn(2, 8, 5, device=DEVICE)], meta, y, [0])    # rank 5 vs 4
    with pytest.raises(ValueError, match="must be contiguous"):
        lora_shrink_expand(x, a, [torch.randn(2, 4, 8, device=DEVICE).transpose(1, 2)], meta, y, [0])
    with pytest.raises(ValueError, match="slice_offsets: expected 1 host ints"):
        lora_shrink_expand(x, a, b, meta, y, [0, 0])
    with pytest.raises(ValueError, match=r"slice_offsets\[0\]: expected a host int"):
        lora_shrink_expand(x, a, b, meta, y, [torch.tensor(0)])
    with pytest.raises(ValueError, match="exceed"):
        lora_shrink_expand(x, a, b, meta, y, [4])
    with pytest.raises(ValueError, match="meta: built for 3 tokens"):
        lora_shrink_expand(x[:2], a, b, meta, y[:2], [0])
    with pytest.raises(ValueError, match="meta: built for max_loras=2"):
        lora_shrink_expand(x, torch.randn(1, 3, 4, 16, device=DEVICE), [torch.randn(3, 8, 4, device=DEVICE)],
                           meta, y, [0])
    with pytest.raises(ValueError, match="config: expected LoRAFusedConfig"):
        lora_shrink_expand(x, a, b, meta, y, [0], config={"block_m": 16})


# ----------------------------------------------------------------------------------------
# GPU: real sizes (Llama-3-8B qkv and down, rank 16) with the CUDA default configs
# ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,max_loras,popularity,fixed_grid", [
    (64, 64, "distinct", True), (256, 16, "zipf", True), (64, 4, "identical", False),
    (1, 4, "uniform", False)])
@pytest.mark.parametrize("in_dim,out_dims", [(4096, (4096, 1024, 1024)), (14336, (4096,))],
                         ids=["qkv", "down"])
def test_gpu_real_sizes(dtype, num_tokens, max_loras, popularity, fixed_grid, in_dim, out_dims):
    g = torch.Generator().manual_seed(0)
    slots = make_slots(num_tokens, max_loras, popularity, True, seed=1)
    meta = build_lora_kernel_meta(slots, max_loras, fixed_grid=fixed_grid)
    x = randn(g, num_tokens, in_dim).to(dtype)
    lora_a = (randn(g, len(out_dims), max_loras, 16, in_dim) / in_dim ** 0.5).to(dtype)
    lora_b = [(randn(g, max_loras, n, 16) / 4).to(dtype) for n in out_dims]
    offsets = [sum(out_dims[:s]) for s in range(len(out_dims))]
    y0 = randn(g, num_tokens, sum(out_dims)).to(dtype)
    y = y0.clone()
    lora_shrink_expand(x, lora_a, lora_b, meta, y, offsets)
    y_ref = lora_shrink_expand_ref(x, lora_a, lora_b, slots, y0, offsets)
    tol = 2 * Y_TOL[dtype]
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
