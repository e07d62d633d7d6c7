"""W4A16 matmul (int4 weights packed along K, 16-bit activations): the Triton kernel against its torch
twin (``kernels.w4a16.w4a16_matmul_ref``), the packing helpers, the launch-config picker and the
wrapper's checks. CPU tensors run through the interpreter with small explicit tiles (N and K tails,
several groups per K step, split-K); the CUDA tests run Llama-3-8B sizes."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import kernels.w4a16 as w4a16_module
from kernels.w4a16 import (DECODE_DEFAULTS, GEMV_DOT, GEMV_FMA, GEMV_MAX_ROWS, MAX_SUB_TILES, TILES, ShapeDefault,
                           W4A16Config, dequantize_w4, pack_int4_along_k, unpack_int4_along_k, w4a16_config,
                           w4a16_matmul, w4a16_matmul_ref)
from tests.kernels.pairwise import pairwise

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _tol(dtype):
    # One rounding of the float32 result: the interpreter truncates fp32 -> bf16 where torch rounds
    # to nearest, so bf16 may land one ulp apart.
    return dict(float32=(1e-5, 1e-5), float16=(2e-3, 2e-3), bfloat16=(2e-2, 2e-2))[str(dtype).split(".")[1]]


@dataclasses.dataclass
class Case:
    """Inputs of one call."""

    x: torch.Tensor            # [M, K]
    qweight: torch.Tensor      # int32 [K // 8, N]
    scales: torch.Tensor       # [K // G, N]
    zeros: torch.Tensor        # [K // G, N]
    group_size: int
    bias: torch.Tensor | None  # [N]

    def args(self):
        return (self.x, self.qweight, self.scales, self.zeros, self.group_size, self.bias)


def _case(m: int, n: int, k: int, group_size: int, dtype, *, bias: bool, zeros: str = "sym",
          scales_dtype=None, strided: bool = False, seed: int = 0) -> Case:
    """Random int4 weights; zeros "sym" (all 8), "asym" (integers 0..15) or "frac" (floats in [0, 15])."""
    g = torch.Generator().manual_seed(seed + 1000 * m + 7 * n + k + group_size)
    num_groups = k // group_size
    q = torch.randint(0, 16, (k, n), generator=g)                                          # [K, N]
    # scales ~ 1 / (4.6 sqrt(K)) keep the outputs O(1) (q - z has std ~4.6).
    scales = (0.5 + torch.rand(num_groups, n, generator=g)) / (4.6 * k ** 0.5)              # [K // G, N]
    if zeros == "sym":
        z = torch.full((num_groups, n), 8.0)
    elif zeros == "asym":
        z = torch.randint(0, 16, (num_groups, n), generator=g).float()
    else:
        z = 15 * torch.rand(num_groups, n, generator=g)
    sdt = scales_dtype or dtype
    x = torch.randn(m, k + (24 if strided else 0), generator=g).to(dtype)
    x = x[:, 8:8 + k] if strided else x
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    return Case(x.to(DEVICE), pack_int4_along_k(q).to(DEVICE), scales.to(sdt).to(DEVICE),
                z.to(sdt).to(DEVICE), group_size, b)


def _check(case: Case, config, dtype, tol=None):
    before = [t.clone() for t in case.args() if isinstance(t, torch.Tensor)]
    out = w4a16_matmul(*case.args(), config=config)
    ref = w4a16_matmul_ref(*case.args())
    rtol, atol = tol or _tol(dtype)
    assert out.dtype == dtype and out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)
    for t, t0 in zip([t for t in case.args() if isinstance(t, torch.Tensor)], before):   # inputs untouched
        assert torch.equal(t, t0)


# (N, K, G, bias, zeros): N tails of 16/32-wide tiles, several groups, per-channel (G = K) with a K tail.
SHAPES = [(40, 256, 32, True, "asym"), (48, 256, 128, False, "sym"), (24, 200, 200, True, "asym")]


@pytest.mark.parametrize("dtype,m,shape", pairwise(DTYPES, [1, 3, 16, 33], range(len(SHAPES))))
def test_matches_twin(dtype, m, shape):
    """One K step per group (block_k 32 / 64), 16 x 32 tiles: tails in M (33 = 2 x 16 + 1), N and K;
    every pair of dtype, M and shape."""
    n, k, group_size, bias, zeros = SHAPES[shape]
    config = W4A16Config(block_m=16, block_n=32 if n == 40 else 16, block_k=min(64, group_size), num_stages=1)
    _check(_case(m, n, k, group_size, dtype, bias=bias, zeros=zeros), config, dtype)


# ----------------------------------------------------------------------------------------
# Decode GEMV forms (M <= 16)
# ----------------------------------------------------------------------------------------
# (form, block_k): the FMA form one group a step (64) and several groups a step (256: per packed row
# scales for G = 32 / 64), the tl.dot form (128, clipped to the group; G < 128 runs the FMA form).
GEMV_FORMS = [(GEMV_FMA, 64), (GEMV_FMA, 256), (GEMV_DOT, 128)]
# (G, zeros): grouped symmetric / asymmetric, per-channel (G = K, with a K tail past the last step).
GEMV_GROUPS = [(32, "asym"), (64, "sym"), (128, "asym"), (0, "sym")]


GEMV_CASES = [(m, *form, *group) for m, (form, group) in
              zip(itertools.cycle([1, 2, 3, 7, 16]), itertools.product(GEMV_FORMS, GEMV_GROUPS))]
"""Every form with every group (m: 1, 2, 3, 7 and 16 in turn)."""


@pytest.mark.parametrize("m,form,block_k,group_size,zeros", GEMV_CASES)
def test_gemv_matches_twin(m, form, block_k, group_size, zeros):
    """bfloat16 x (read as int32 pairs), N = 37 (a column tail), K = 264 per-channel (a K tail), bias."""
    k = 264 if group_size == 0 else 256
    case = _case(m, 37, k, group_size or k, torch.bfloat16, bias=True, zeros=zeros)
    _check(case, W4A16Config(form=form, block_n=16, block_k=block_k, num_stages=1), torch.bfloat16)


@pytest.mark.parametrize("form,dtype", [(GEMV_FMA, torch.float32), (GEMV_DOT, torch.float16)])
def test_gemv_other_dtypes_split_k(form, dtype):
    """float32 / float16 x (loaded per input), 4 K slices + the reduce launch, 5 rows, G 128."""
    case = _case(5, 40, 1024, 128, dtype, bias=True, zeros="asym")
    _check(case, W4A16Config(form=form, block_n=32, block_k=128, split_k=4, num_stages=1), dtype)


@pytest.mark.parametrize("zeros", ["frac", "asym"])
def test_gemv_strided_rows_and_fractional_zeros(zeros):
    """bfloat16 rows at an odd row stride (no int32 pairs), float32 fractional zero points (rounded to
    2^-8 of a q step at most), 9 rows."""
    case = _case(9, 24, 128, 32, torch.bfloat16, bias=False, zeros=zeros, scales_dtype=torch.float32)
    x = torch.randn(9, 129, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)[:, 1:].to(DEVICE)
    assert x.stride(0) % 2 == 1
    case.x = x
    for form in (GEMV_FMA, GEMV_DOT):
        _check(case, W4A16Config(form=form, block_n=16, block_k=64, num_stages=1), torch.bfloat16)


# (form, block_n, block_k, split_k, reduce_in_kernel, num_warps, num_stages): every launch knob of the GEMV.
GEMV_KNOBS = [(GEMV_FMA, 16, 64, 1, 0, 4, 1), (GEMV_FMA, 32, 128, 2, 0, 2, 1), (GEMV_FMA, 16, 64, 4, 1, 4, 2),
              (GEMV_FMA, 64, 256, 2, 1, 8, 1), (GEMV_DOT, 16, 128, 1, 0, 4, 1), (GEMV_DOT, 32, 128, 2, 1, 4, 2),
              (GEMV_DOT, 16, 256, 4, 0, 8, 1)]


GEMV_KNOB_CASES = [(*knobs, *GEMV_GROUPS[i % len(GEMV_GROUPS)]) for i, knobs in enumerate(GEMV_KNOBS)]
"""Every knob row once, the groups in turn."""


@pytest.mark.parametrize(
    "form,block_n,block_k,split_k,reduce_in_kernel,num_warps,num_stages,group_size,zeros", GEMV_KNOB_CASES)
def test_gemv_launch_knobs(form, block_n, block_k, split_k, reduce_in_kernel, num_warps, num_stages, group_size,
                           zeros):
    """Every GEMV knob against the twin: 3 rows (2 with the FMA form's wide tile), N = 45 (a tail of every
    block_n), K = 512 (per-channel: 520, a K tail), bias; split-K reduced by the second launch or in the
    kernel; groups 32 / 64 / 128 / per-channel in turn, symmetric and asymmetric zero points."""
    k = 520 if group_size == 0 else 512
    m = 2 if block_k == 256 and form == GEMV_FMA else 3
    case = _case(m, 45, k, group_size or k, torch.bfloat16, bias=True, zeros=zeros)
    config = W4A16Config(form=form, block_n=block_n, block_k=block_k, split_k=split_k,
                         reduce_in_kernel=reduce_in_kernel, num_warps=num_warps, num_stages=num_stages)
    _check(case, config, torch.bfloat16)


def _count_reduce_launches(monkeypatch) -> list:
    calls = []
    real = w4a16_module._reduce_splits
    monkeypatch.setattr(w4a16_module, "_reduce_splits", lambda *a: (calls.append(1), real(*a)))
    return calls


@pytest.mark.parametrize("form,group_size", [(GEMV_FMA, 32), (GEMV_DOT, 0), (TILES, 128)])
def test_reduce_in_kernel(monkeypatch, form, group_size):
    """reduce_in_kernel=1: no second launch, the same result as the twin, every arrival counter back at 0
    (a second call reuses them); 5 rows (20 for the tiled kernel: 2 M tiles x 3 N tiles), 4 K slices."""
    calls = _count_reduce_launches(monkeypatch)
    m = 20 if form == TILES else 5
    case = _case(m, 40, 1024, group_size or 1024, torch.bfloat16, bias=True, zeros="asym")
    config = W4A16Config(form=form, block_m=16, block_n=16, block_k=128, split_k=4, reduce_in_kernel=1,
                         num_stages=1)
    for _ in range(2):
        _check(case, config, torch.bfloat16)
    assert not calls
    assert all(int(c.abs().sum()) == 0 for c in w4a16_module._COUNTERS.values())


def test_reduce_in_kernel_falls_back_past_the_counters(monkeypatch):
    """More output tiles than ARRIVAL_COUNTERS: the second launch reduces (same result)."""
    calls = _count_reduce_launches(monkeypatch)
    monkeypatch.setattr(w4a16_module, "ARRIVAL_COUNTERS", 2)
    case = _case(2, 48, 512, 64, torch.float32, bias=True, zeros="asym")                # 3 tiles of 16
    _check(case, W4A16Config(form=GEMV_FMA, block_n=16, block_k=64, split_k=2, reduce_in_kernel=1,
                             num_stages=1), torch.float32)
    assert len(calls) == 1


def test_act_order_permuted_inputs():
    """Act order (g_idx): the layer's scheme, permute the inputs so that each group is contiguous (q's
    rows and x's columns alike), runs the GEMV and the tiled kernel to x @ W of the original order."""
    g = torch.Generator().manual_seed(5)
    k, n, group = 256, 24, 64
    g_idx = torch.randperm(k, generator=g) // group                                     # [K] group of each input
    q = torch.randint(0, 16, (k, n), generator=g)                                       # [K, N]
    scales = (0.5 + torch.rand(k // group, n, generator=g)) / (4.6 * k ** 0.5)           # [K // G, N]
    zeros = torch.randint(0, 16, (k // group, n), generator=g).float()
    w = (q.float() - zeros[g_idx]) * scales[g_idx]                                       # [K, N]
    order = torch.argsort(g_idx, stable=True)
    qweight = pack_int4_along_k(q[order]).to(DEVICE)
    for m, config in [(3, W4A16Config(form=GEMV_FMA, block_n=16, block_k=64, num_stages=1)),
                      (20, W4A16Config(block_m=16, block_n=16, block_k=64, num_stages=1))]:
        x = torch.randn(m, k, generator=g)                                               # [M, K]
        out = w4a16_matmul(x[:, order].contiguous().to(DEVICE), qweight, scales.to(DEVICE), zeros.to(DEVICE),
                           group, config=config)
        torch.testing.assert_close(out.cpu(), x @ w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,group_size", [(17, 0), (40, 128), (64, 0)])
def test_gemv_dot_up_to_64_rows(m, group_size):
    """The tl.dot form holds all 17-64 rows in one program (BLOCK_M 32 / 64): N = 37, 2 K slices reduced
    in the kernel, bias; per-channel with a K tail."""
    k = 264 if group_size == 0 else 256
    case = _case(m, 37, k, group_size or k, torch.bfloat16, bias=True, zeros="asym")
    config = W4A16Config(form=GEMV_DOT, block_n=16, block_k=128, split_k=2, reduce_in_kernel=1, num_stages=1)
    assert w4a16_module._gemv_form(config, m, k, group_size or k) == GEMV_DOT
    _check(case, config, torch.bfloat16)


def test_gemv_form_routing():
    """Which kernel a config runs by rows: FMA to 16, tl.dot to 64, tl.dot with steps under 128 inputs
    (small groups or block_k) as FMA to 4 rows, the tiled kernel beyond."""
    route = w4a16_module._gemv_form
    fma, dot = W4A16Config(form=GEMV_FMA, block_k=128), W4A16Config(form=GEMV_DOT, block_k=128)
    assert route(fma, 16, 4096, 128) == GEMV_FMA and route(fma, 17, 4096, 128) is None
    assert route(dot, 64, 4096, 128) == GEMV_DOT and route(dot, 65, 4096, 128) is None
    assert route(dot, 64, 4096, 4096) == GEMV_DOT                                      # per-channel
    assert route(dot, 4, 4096, 64) == GEMV_FMA and route(dot, 5, 4096, 64) is None     # groups of 64
    assert route(W4A16Config(form=GEMV_DOT, block_k=64), 3, 4096, 128) == GEMV_FMA
    assert route(W4A16Config(), 1, 4096, 128) is None


def test_gemv_form_above_16_rows_runs_tiles():
    """A GEMV config on 17 rows runs the tiled kernel (its block_m)."""
    case = _case(17, 24, 128, 64, torch.float32, bias=True, zeros="asym")
    _check(case, W4A16Config(form=GEMV_FMA, block_m=16, block_n=16, block_k=64, num_stages=1), torch.float32)


@pytest.mark.parametrize("group_size,scale_in_weight,dtype",
                         pairwise([32, 64], [0, 1], [torch.float32, torch.bfloat16]))
def test_several_groups_per_step(group_size, scale_in_weight, dtype):
    """block_k 128 over groups of 32 / 64: 4 / 2 sub-tiles per K step, each with its group's scale;
    K = 320 leaves a last step whose trailing sub-tiles lie past K."""
    config = W4A16Config(block_m=16, block_n=16, block_k=128, scale_in_weight=scale_in_weight, num_stages=1)
    _check(_case(5, 24, 320, group_size, dtype, bias=True, zeros="asym"), config, dtype)


@pytest.mark.parametrize("split_k,group_size", [(2, 512), (4, 64)])
def test_split_k(split_k, group_size):
    """K = 512 in 8 steps of 64 over 2 / 4 slices, grouped and per-channel, bias in the reduce."""
    config = W4A16Config(block_m=16, block_n=16, block_k=64, split_k=split_k, num_stages=1)
    _check(_case(3, 40, 512, group_size, torch.float16, bias=True, zeros="asym"), config, torch.float16)


def test_split_k_more_slices_than_steps():
    """split_k 8 over 3 K steps: 3 slices, none empty."""
    config = W4A16Config(block_m=16, block_n=16, block_k=64, split_k=8, num_stages=1)
    _check(_case(2, 16, 192, 64, torch.float32, bias=False, zeros="sym"), config, torch.float32)


def test_gemm_tiles_and_grouped_order():
    """M = 70 over 32-row tiles (3 M tiles), 3 N tiles walked 2 M-tile rows at a time."""
    config = W4A16Config(block_m=32, block_n=16, block_k=32, group_m=2, scale_in_weight=1, num_stages=1)
    _check(_case(70, 48, 64, 32, torch.float32, bias=True, zeros="asym"), config, torch.float32)


@pytest.mark.parametrize("zeros", ["frac", "asym"])
def test_float32_scales_and_fractional_zeros(zeros):
    """float32 scales / zeros with bfloat16 x; a fractional zero point (rounded into bf16's q - z on GPU)."""
    case = _case(4, 24, 128, 32, torch.bfloat16, bias=True, zeros=zeros, scales_dtype=torch.float32)
    _check(case, W4A16Config(block_m=16, block_n=16, block_k=32, num_stages=1), torch.bfloat16)


def test_strided_rows_and_default_config():
    """config=None (the interpreter's default tiles) on x rows with a row stride > K."""
    _check(_case(6, 40, 136, 136, torch.float32, bias=True, zeros="asym", strided=True), None, torch.float32)


def test_zero_rows():
    case = _case(0, 24, 64, 32, torch.float32, bias=True)
    assert w4a16_matmul(*case.args()).shape == (0, 24)


# ----------------------------------------------------------------------------------------
# Layout helpers
# ----------------------------------------------------------------------------------------
def test_pack_order_and_round_trip():
    q = torch.arange(8).repeat(2, 1).t().contiguous()                          # [8, 2]: column = 0..7
    q[:, 1] = 15                                                               # all ones: -1 as int32
    packed = pack_int4_along_k(q)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    assert packed[0, 0].item() == 0x76543210 and packed[0, 1].item() == -1
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.uint8, torch.int32, torch.int64):
        q = torch.randint(0, 16, (64, 7), generator=g).to(dtype)
        assert torch.equal(unpack_int4_along_k(pack_int4_along_k(q)), q.to(torch.int32))
    q = torch.randint(0, 16, (5, 16), generator=g)
    assert torch.equal(unpack_int4_along_k(pack_int4_along_k(q.t())), q.t().to(torch.int32))   # strided q


def test_dequantize_w4():
    case = _case(1, 8, 64, 32, torch.float32, bias=False, zeros="asym")
    q = unpack_int4_along_k(case.qweight).float()                                       # [K, N]
    k = torch.arange(64)
    want = (q - case.zeros[k // 32]) * case.scales[k // 32]
    torch.testing.assert_close(dequantize_w4(case.qweight, case.scales, case.zeros, 32), want, rtol=0, atol=0)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4_along_k(torch.zeros(12, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="0..15"):
        pack_int4_along_k(torch.full((8, 4), 16))
    with pytest.raises(ValueError, match="0..15"):
        pack_int4_along_k(torch.full((8, 4), -1))
    with pytest.raises(ValueError, match="integer dtype"):
        pack_int4_along_k(torch.zeros(8, 4))


# ----------------------------------------------------------------------------------------
# Launch configs
# ----------------------------------------------------------------------------------------
def test_default_configs(monkeypatch):
    """The rules under ``SHAPE_DEFAULTS`` (emptied here: it lists the Llama-3-8B shapes). Decode (M <= 16): the
    ``DECODE_DEFAULTS`` row of M, split-K only where the N tiles leave SMs idle (never below 2 K steps a slice);
    GEMM tiles above with the scale folded into the weight tile."""
    monkeypatch.setattr(w4a16_module, "SHAPE_DEFAULTS", ())
    assert DECODE_DEFAULTS[-1].max_rows == GEMV_MAX_ROWS
    for m in range(1, GEMV_MAX_ROWS + 1):
        row = next(r for r in DECODE_DEFAULTS if m <= r.max_rows)
        for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:      # Llama-3-8B
            cfg = w4a16_config(m, n, k)
            assert cfg.form == row.config.form != TILES and cfg.block_n == row.config.block_n
            tiles, steps = -(-n // cfg.block_n), -(-k // cfg.block_k)
            assert cfg.split_k == 1 or tiles * cfg.split_k // 2 < row.programs_per_sm * 132
            assert steps // cfg.split_k >= row.min_steps_per_split and cfg.split_k <= row.max_split_k
    assert w4a16_config(1, 4096, 4096).split_k > 1                                    # 64 N tiles
    assert w4a16_config(1, 4096, 512).split_k == 2 and w4a16_config(1, 4096, 256).split_k == 1
    assert w4a16_config(33, 4096, 4096).block_m == 64 and w4a16_config(20, 4096, 4096).block_m == 32
    assert w4a16_config(17, 4096, 4096).form == TILES
    big = w4a16_config(2048, 4096, 4096)
    assert (big.block_m, big.block_n, big.scale_in_weight, big.form) == (128, 128, 1, TILES)
    cpu = w4a16_config(1, 4096, 4096, device=torch.device("cpu"))                    # interpreter tiles
    assert cpu.num_stages == 1 and cpu.form == GEMV_FMA


def test_shape_defaults_table(monkeypatch):
    """SHAPE_DEFAULTS rows win for their (N, K) and the smallest bucket holding M; other shapes and M past
    the largest bucket take the rules; overrides apply on top; the interpreter keeps its tiles."""
    tuned = [ShapeDefault(4096, 4096, 1, W4A16Config(form=GEMV_FMA, block_n=32, block_k=512, split_k=2)),
             ShapeDefault(4096, 4096, 16, W4A16Config(form=GEMV_DOT, block_n=128, reduce_in_kernel=1)),
             ShapeDefault(4096, 4096, 64, W4A16Config(block_m=64, block_n=128, split_k=4, reduce_in_kernel=1))]
    monkeypatch.setattr(w4a16_module, "SHAPE_DEFAULTS", tuple(reversed(tuned)))
    assert w4a16_config(1, 4096, 4096) == tuned[0].config
    assert w4a16_config(2, 4096, 4096) == w4a16_config(16, 4096, 4096) == tuned[1].config
    assert w4a16_config(17, 4096, 4096) == tuned[2].config
    assert w4a16_config(65, 4096, 4096).split_k == 1                                # past the buckets: rules
    assert w4a16_config(1, 6144, 4096).block_k == DECODE_DEFAULTS[0].config.block_k
    assert w4a16_config(1, 4096, 4096, override=(("num_warps", 8),)).num_warps == 8
    assert w4a16_config(1, 4096, 4096, device=torch.device("cpu")).block_k != 512


def test_sweep_grid_is_bounded():
    """The H200 sweep's grid (benchmarks/sweeps/w4a16_sweep.py) at its default shapes and M: valid configs,
    both reductions for every split, and few enough launches to compile and time in one run."""
    import dataclasses as dc

    from benchmarks.sweeps.w4a16_sweep import SHAPES, candidate_configs

    total, launches = 0, set()
    for m in (1, 4, 16, 64):
        for n, k in SHAPES.values():
            configs = candidate_configs(m, n, k, 128)
            assert configs and all(isinstance(c, W4A16Config) for c in configs)
            splits = [c for c in configs if c.split_k > 1]
            assert sum(c.reduce_in_kernel for c in splits) * 2 == len(splits)
            total += len(configs)
            launches |= {(m, dc.replace(c, split_k=min(c.split_k, 2))) for c in configs}
    assert total <= 800 and len(launches) <= 120, (total, len(launches))


def test_config_override_and_checks():
    cfg = w4a16_config(1, 4096, 4096, override=(("block_n", 64), ("split_k", 2)))
    assert (cfg.block_n, cfg.split_k) == (64, 2)
    with pytest.raises(ValueError, match="unknown field.*tile_n"):
        w4a16_config(1, 4096, 4096, override=(("tile_n", 32),))
    for field, value in [("block_m", 8), ("block_n", 24), ("block_k", 8), ("split_k", 3), ("num_warps", 3),
                         ("num_stages", 0), ("group_m", 0), ("scale_in_weight", 2), ("block_n", True),
                         ("form", 3), ("form", True)]:
        with pytest.raises(ValueError, match=field):
            W4A16Config(**{field: value})


def test_block_k_clipped_to_sub_tiles():
    """block_k 4096 over groups of 16 runs as MAX_SUB_TILES sub-tiles of 16 per step, same result."""
    assert MAX_SUB_TILES * 16 < 4096
    config = W4A16Config(block_m=16, block_n=16, block_k=4096, num_stages=1)
    _check(_case(2, 16, 96, 16, torch.float32, bias=False, zeros="asym"), config, torch.float32)


# ----------------------------------------------------------------------------------------
# Wrapper checks
# ----------------------------------------------------------------------------------------
def test_checks_reject_bad_inputs():
    c = _case(2, 24, 64, 32, torch.float32, bias=True)
    x, qw, s, z, g, b = c.args()
    with pytest.raises(ValueError, match="x: expected 2 dims"):
        w4a16_matmul(x[None], qw, s, z, g)
    with pytest.raises(ValueError, match="x: dtype"):
        w4a16_matmul(x.to(torch.int32), qw, s, z, g)
    with pytest.raises(ValueError, match="x: last dim must have stride 1"):
        w4a16_matmul(torch.randn(64, 2, device=DEVICE).t(), qw, s, z, g)
    with pytest.raises(ValueError, match="multiple of 8"):
        w4a16_matmul(torch.randn(2, 60, device=DEVICE), qw, s, z, g)
    with pytest.raises(ValueError, match="qweight: dtype"):
        w4a16_matmul(x, qw.to(torch.int64), s, z, g)
    with pytest.raises(ValueError, match="qweight: expected shape"):
        w4a16_matmul(x, torch.cat([qw, qw]), s, z, g)                                 # 16 rows, K // 8 = 8
    with pytest.raises(ValueError, match="qweight: must be contiguous"):
        w4a16_matmul(x, torch.zeros(24, 8, dtype=torch.int32, device=DEVICE).t(), s, z, g)
    for bad in (48, 8, 128, True, 32.0):                                             # not pow2 / < 16 / > K
        with pytest.raises(ValueError, match="group_size"):
            w4a16_matmul(x, qw, s, z, bad)
    with pytest.raises(ValueError, match="scales: expected shape"):
        w4a16_matmul(x, qw, s[:1], z, g)
    with pytest.raises(ValueError, match="scales: dtype"):
        w4a16_matmul(x, qw, s.half(), z.half(), g)                                  # neither x's nor float32
    with pytest.raises(ValueError, match="zeros: dtype"):
        w4a16_matmul(x.half(), qw, s, z.half(), g)                     # scales float32, zeros fp16
    with pytest.raises(ValueError, match="zeros: expected shape"):
        w4a16_matmul(x, qw, s, z.t().contiguous(), g)
    with pytest.raises(ValueError, match="bias: expected shape"):
        w4a16_matmul(x, qw, s, z, g, b[:-1])
    with pytest.raises(ValueError, match="bias: dtype"):
        w4a16_matmul(x, qw, s, z, g, b.half())
    with pytest.raises(ValueError, match="config"):
        w4a16_matmul(x, qw, s, z, g, config=dict(block_n=16))


# ----------------------------------------------------------------------------------------
# CUDA: Llama-3-8B sizes
# ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("group_size", [128, 0])                                    # 0: per-channel
@pytest.mark.parametrize("m", [1, 7, 16, 64, 300])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1024, 4096)])
def test_gpu_real_sizes(n, k, m, group_size):
    g = group_size or k
    # Default configs; bf16's W rounding (scale_in_weight at M > 16) stays well inside 2e-2.
    _check(_case(m, n, k, g, torch.bfloat16, bias=(n == 6144), zeros="asym"), None, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("form", [GEMV_FMA, GEMV_DOT])
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n,k,group_size", [(6144, 4096, 128), (4096, 14336, 0), (1000, 4096, 64)])
def test_gpu_gemv_forms(n, k, group_size, m, form):
    """Both GEMV forms at Llama-3-8B sizes, split 4 (and 1 for the default), per-channel and G 64."""
    g = group_size or k
    case = _case(m, n, k, g, torch.bfloat16, bias=(n == 6144), zeros="asym")
    for split, reduce_in_kernel in ((1, 0), (4, 0), (4, 1)):
        _check(case, W4A16Config(form=form, block_n=64, block_k=128, split_k=split, reduce_in_kernel=reduce_in_kernel,
                                 num_stages=1), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("form", [GEMV_FMA, GEMV_DOT, TILES])
def test_gpu_reduce_in_kernel_repeated(form):
    """The in-kernel split-K reduction 30 times back to back at o_proj's size (64 column tiles x 8 slices
    racing for each counter): every output matches the twin and the counters end at 0."""
    m = 64 if form == TILES else 4
    case = _case(m, 4096, 4096, 128, torch.bfloat16, bias=False, zeros="asym")
    config = W4A16Config(form=form, block_m=64, block_n=64, block_k=128, split_k=8, reduce_in_kernel=1,
                         num_stages=1 if form != TILES else 3, scale_in_weight=1)
    ref = w4a16_matmul_ref(*case.args()).float()
    outs = [w4a16_matmul(*case.args(), config=config) for _ in range(30)]
    for out in outs:
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in w4a16_module._COUNTERS.values())


# ----------------------------------------------------------------------------------------
# Compiled for Hopper on any machine (the interpreter does not type-check what the compiler does)
# ----------------------------------------------------------------------------------------
_COMPILE_SCRIPT = """
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile
from kernels.w4a16 import _w4a16_gemv_kernel, _w4a16_kernel

common = dict(x_ptr="*bf16", qw_ptr="*i32", s_ptr="*bf16", z_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16",
              ws_ptr="*fp32", cnt_ptr="*i32", M="i32", N="i32", K="i32", stride_xm="i32")
flags = dict(GROUP_SIZE=128, HAS_BIAS=True, SPLIT_OUT=True, REDUCE_IN_KERNEL=True, BLOCK_N=64, BLOCK_K=128,
             DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32")
cases = [(_w4a16_gemv_kernel, dict(k_steps_per_split="i32", num_splits="i32", exp_bits="i32"),
          dict(BLOCK_M=use_dot and 16 or 2, USE_DOT=use_dot, X_PAIRS=not use_dot, MASK_X=False))
         for use_dot in (False, True)]
cases.append((_w4a16_kernel, dict(k_tiles_per_split="i32", num_splits="i32"),
              dict(BLOCK_M=64, SUB_K=128, GROUP_M=8, SCALE_IN_WEIGHT=True)))
for fn, signature, consts in cases:
    consts = {**flags, **consts}
    source = ASTSource(fn=fn, signature={**common, **signature, **{k: "constexpr" for k in consts}},
                       constexprs=consts)
    compiled = triton_compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=1))
    assert compiled.asm["cubin"], fn
    print("compiled", fn.__name__)
"""


def test_kernels_compile_for_sm90(tmp_path):
    """The GEMV (both forms) and the tiled kernel, with split-K reduced in the kernel and a bias, compile
    to sm_90 cubins through Triton's bundled ptxas with no GPU."""
    from tests.kernels.compile_sm90 import run_compile_script

    assert run_compile_script(_COMPILE_SCRIPT, tmp_path).count("compiled") == 3
