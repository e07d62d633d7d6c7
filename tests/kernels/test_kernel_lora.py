"""LoRA shrink/expand kernels and the per-step meta builder against the torch twins.

Parametrized over every pair of dtype, rank, adapter popularity (distinct, uniform, Zipf, identical)
and base-model rows (``tests.kernels.pairwise``), with odd hidden sizes, 1..3 slices, 1..33 tokens,
1..4 slots and split-K partials (1, 2, 8 splits), exact and fixed grid; plus explicit launch configs
and overrides.
"""

from __future__ import annotations

import pytest
import torch

from kernels.lora_expand import LoRAExpandConfig, lora_expand, lora_expand_config
from kernels.lora_meta import NO_LORA, build_lora_kernel_meta, max_split_k, shrink_buffer_rows
from kernels.lora_shrink import LoRAShrinkConfig, lora_shrink, lora_shrink_config
from kernels.reference import lora_expand_ref, lora_shrink_ref
from tests.kernels.pairwise import pairwise

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""CPU tensors run the kernels through the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
RANKS = [1, 4, 8, 16]
POPULARITY = ["distinct", "uniform", "zipf", "identical"]
SHAPES = [(72, (48, 16, 16)), (100, (37,)), (37, (100, 72))]
"""(in_dim, out_dim of each slice): packed qkv-like, one odd slice, two wide slices."""
NUM_TOKENS = [1, 7, 33]
MAX_LORAS = [1, 3, 4]
SPLIT_K = [1, 2, 8]

Y_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
"""atol = rtol on y per dtype (about one ulp; the interpreter truncates to bf16)."""


def make_slots(num_tokens: int, max_loras: int, popularity: str, with_base: bool, seed: int) -> torch.Tensor:
    """Slots per token, request by request (chunks of 1..8 tokens share an adapter)."""
    g = torch.Generator().manual_seed(seed)
    chunks, left = [], num_tokens
    while left:
        n = min(left, int(torch.randint(1, 9, (1,), generator=g)))
        chunks.append(n)
        left -= n
    if popularity == "distinct":
        req_slots = [i % max_loras for i in range(len(chunks))]
    elif popularity == "uniform":
        req_slots = torch.randint(0, max_loras, (len(chunks),), generator=g).tolist()
    elif popularity == "zipf":
        probs = 1.0 / torch.arange(1, max_loras + 1, dtype=torch.float64) ** 1.2
        perm = torch.randperm(max_loras, generator=g)
        req_slots = perm[torch.multinomial(probs, len(chunks), replacement=True, generator=g)].tolist()
    elif popularity == "identical":
        req_slots = [max_loras - 1] * len(chunks)
    else:
        raise ValueError(popularity)
    if with_base and len(chunks) > 1:
        for i in range(len(chunks)):
            if i == 0 or torch.rand(1, generator=g).item() < 0.3:
                req_slots[i] = NO_LORA
        if all(s == NO_LORA for s in req_slots):
            req_slots[-1] = max_loras - 1
    slots = [s for n, s in zip(chunks, req_slots) for _ in range(n)]
    return torch.tensor(slots, dtype=torch.int32, device=DEVICE)


SLOT_CASES = pairwise(DTYPES, [1, 8, 16], POPULARITY, [False, True])
"""(dtype, rank, popularity, with_base) cases (every pair of values) shared by the kernels that fuse a
LoRA update into another op (``test_kernel_lora_silu_mul``)."""
SLOT_CASE_IDS = [f"{str(dt).removeprefix('torch.')}-r{r}-{p}-{'base' if b else 'nobase'}"
                 for dt, r, p, b in SLOT_CASES]


def slot_case_sizes(i: int) -> tuple[int, int]:
    """(num_tokens, max_loras) of SLOT_CASES[i]: 1, 7 or 33 tokens over 1, 3 or 4 slots (4 for one token)."""
    num_tokens = (1, 7, 33)[i % 3]
    return num_tokens, ((1, 3, 4)[(i // 3) % 3] if num_tokens > 1 else 4)


def randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(DEVICE)


def run_case(dtype, rank, popularity, with_base, num_tokens, max_loras, shape, seed, fixed_grid=False,
             split_k=1, shrink_cfg=None, expand_cfg=None):
    in_dim, out_dims = shape
    g = torch.Generator().manual_seed(seed)
    slots = make_slots(num_tokens, max_loras, popularity, with_base, seed)
    meta = build_lora_kernel_meta(slots, max_loras, fixed_grid=fixed_grid)
    num_slices = len(out_dims)
    x = randn(g, num_tokens, in_dim).to(dtype)                                       # [T, in_dim]
    lora_a = (randn(g, num_slices, max_loras, rank, in_dim) / in_dim ** 0.5).to(dtype)
    lora_b = [randn(g, max_loras, n, rank).to(dtype) for n in out_dims]
    offsets = [sum(out_dims[:s]) for s in range(num_slices)]
    y = randn(g, num_tokens, sum(out_dims) + 3).to(dtype)                           # 3 spare columns

    # NaN everywhere: every partial of a LoRA row must be stored (there is no memset).
    buf = torch.full((num_slices, split_k, num_tokens, rank), float("nan"), device=DEVICE)  # [S, split, T, R]
    lora_shrink(x, lora_a, meta, buf, scale=0.5, config=shrink_cfg)
    buf_ref = lora_shrink_ref(x, lora_a, slots, scale=0.5, split_k=split_k)         # [S, split, T, rank]
    lora_rows = slots != NO_LORA                                                     # base rows: untouched
    torch.testing.assert_close(buf[:, :, lora_rows], buf_ref[:, :, lora_rows], atol=1e-4, rtol=1e-4)
    assert torch.isnan(buf[:, :, ~lora_rows]).all()

    y_ref = lora_expand_ref(buf_ref, lora_b, slots, y, offsets)
    lora_expand(buf_ref, lora_b, meta, y, offsets, config=expand_cfg)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=Y_TOL[dtype], rtol=Y_TOL[dtype])
    return slots, y, y_ref


CASES = pairwise(DTYPES, RANKS, POPULARITY, [False, True])
CASE_IDS = [f"{str(d).removeprefix('torch.')}-r{r}-{p}-{'base' if b else 'nobase'}" for d, r, p, b in CASES]


@pytest.mark.parametrize("dtype,rank,popularity,with_base", CASES, ids=CASE_IDS)
def test_shrink_expand_matches_ref(dtype, rank, popularity, with_base):
    i = CASES.index((dtype, rank, popularity, with_base))
    # Sizes rotate with the case index: every token count meets every shape and slot count.
    num_tokens = NUM_TOKENS[i % 3]
    max_loras = MAX_LORAS[(i // 3) % 3] if num_tokens > 1 else 4
    run_case(dtype, rank, popularity, with_base, num_tokens, max_loras, SHAPES[(i // 3) % 3], seed=i,
             split_k=SPLIT_K[(i // 2) % 3])


SHAPE_NAMES = ["qkv", "odd", "wide"]


@pytest.mark.parametrize("num_tokens,max_loras,shape", pairwise(NUM_TOKENS, MAX_LORAS, SHAPE_NAMES))
def test_sizes(num_tokens, max_loras, shape):
    slots, y, y_ref = run_case(torch.float16, 8, "uniform", True, num_tokens, max_loras,
                               SHAPES[SHAPE_NAMES.index(shape)],
                               seed=num_tokens * 10 + max_loras, split_k=SPLIT_K[num_tokens % 3])
    base = slots == NO_LORA
    assert torch.equal(y[base], y_ref[base])                                        # base rows untouched


FIXED_CASES = pairwise([torch.bfloat16, torch.float32], POPULARITY, [False, True])


@pytest.mark.parametrize("dtype,popularity,with_base", FIXED_CASES,
                         ids=[f"{str(d).removeprefix('torch.')}-{p}-{'base' if b else 'nobase'}"
                              for d, p, b in FIXED_CASES])
def test_fixed_grid_matches_ref(dtype, popularity, with_base):
    """The CUDA-graph launch (grid over every slot, padding entries exit) equals the twin."""
    i = FIXED_CASES.index((dtype, popularity, with_base))
    run_case(dtype, 16, popularity, with_base, NUM_TOKENS[i % 3] + 4, 5, SHAPES[i % 3], seed=100 + i,
             fixed_grid=True, split_k=SPLIT_K[i % 3])


TOKEN_CASES = pairwise(DTYPES, POPULARITY, [False, True])


@pytest.mark.parametrize("dtype,popularity,with_base", TOKEN_CASES,
                         ids=[f"{str(d).removeprefix('torch.')}-{p}-{'base' if b else 'nobase'}"
                              for d, p, b in TOKEN_CASES])
def test_per_token_expand_matches_ref(dtype, popularity, with_base):
    """The per-token (BGMV) expand equals the twin: every shape, partial count and column split,
    exact and fixed-grid meta; base-model rows untouched."""
    i = TOKEN_CASES.index((dtype, popularity, with_base))
    cfg = LoRAExpandConfig(block_n=16, n_tiles=(1, 2, 4)[i % 3], per_token=1)
    slots, y, y_ref = run_case(dtype, (1, 8, 16)[i % 3], popularity, with_base, NUM_TOKENS[i % 3], 4,
                               SHAPES[(i // 3) % 3], seed=300 + i, fixed_grid=bool(i % 2),
                               split_k=SPLIT_K[(i // 2) % 3], expand_cfg=cfg)
    base = slots == NO_LORA
    assert torch.equal(y[base], y_ref[base])


def test_per_token_expand_at_high_rank():
    """Rank 64 with the decode per-token config (512 columns, 2 warps): 128-column tiles
    (``kernels.lora_expand.token_block_n``) over each program's 512 columns, slices wider than that."""
    slots, y, y_ref = run_case(torch.float32, 64, "zipf", True, 6, 4, (40, (600, 130)), seed=9, fixed_grid=True,
                               expand_cfg=LoRAExpandConfig(16, 512, 1, 2, 2, per_token=1))
    assert torch.equal(y[slots == NO_LORA], y_ref[slots == NO_LORA])


def test_fixed_grid_base_only_touches_nothing():
    """A graph step with no adapter still launches; every program exits, y is unchanged."""
    slots = torch.full((9,), NO_LORA, dtype=torch.int32, device=DEVICE)
    meta = build_lora_kernel_meta(slots, 4, fixed_grid=True)
    assert not meta.no_lora and meta.num_active == 4
    buf = torch.zeros(1, 2, 9, 8, device=DEVICE)
    lora_shrink(torch.randn(9, 40, device=DEVICE), torch.randn(1, 4, 8, 40, device=DEVICE), meta, buf)
    assert torch.all(buf == 0)
    y = torch.randn(9, 24, device=DEVICE)
    y0 = y.clone()
    for cfg in (None, LoRAExpandConfig(block_n=16, per_token=1)):
        lora_expand(torch.randn(1, 2, 9, 8, device=DEVICE), [torch.randn(4, 24, 8, device=DEVICE)], meta, y, [0],
                    config=cfg)
        assert torch.equal(y, y0)


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("with_base", [False, True])
def test_host_grouping_matches_torch_build(popularity, with_base):
    from kernels.lora_meta import group_slots_host

    for num_tokens, max_loras in ((1, 1), (7, 3), (33, 4), (64, 64)):
        slots = make_slots(num_tokens, max_loras, popularity, with_base, seed=num_tokens)
        meta = build_lora_kernel_meta(slots, max_loras)
        g = group_slots_host(slots.cpu().numpy(), max_loras)
        assert g.num_active == meta.num_active
        for name in ("sorted_token_ids", "active_slots", "num_tokens_per_slot", "slot_start"):
            assert getattr(g, name).tolist() == getattr(meta, name).tolist(), name
    with pytest.raises(ValueError, match="values must be in"):
        group_slots_host(torch.tensor([0, 3]).numpy(), 3)


@pytest.mark.parametrize("split_k,fixed_grid", [(1, False), (2, True), (8, False), (16, True)],
                         ids=["1-exact", "2-fixed_grid", "8-exact", "16-fixed_grid"])
def test_split_k_partials(split_k, fixed_grid):
    """Each split stores its own partial over its input chunk (empty chunks store zeros); the
    expand sums them. in_dim 100 with 16 splits: chunks of 16, the last 9 splits are empty."""
    slots = make_slots(33, 4, "zipf", True, seed=5)
    meta = build_lora_kernel_meta(slots, 4, fixed_grid=fixed_grid)
    x = torch.randn(33, 100, device=DEVICE)
    lora_a = torch.randn(2, 4, 8, 100, device=DEVICE) * 0.1
    out = torch.full((2, split_k, 33, 8), float("nan"), device=DEVICE)                # [S, split, T, rank]
    lora_shrink(x, lora_a, meta, out, config=LoRAShrinkConfig(block_k=16, split_k=split_k))
    rows = slots != NO_LORA
    partials = lora_shrink_ref(x, lora_a, slots, split_k=split_k)
    torch.testing.assert_close(out[:, :, rows], partials[:, :, rows], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[:, :, rows].sum(1), lora_shrink_ref(x, lora_a, slots)[:, rows],
                               atol=1e-4, rtol=1e-4)
    lora_b = [torch.randn(4, 24, 8, device=DEVICE), torch.randn(4, 40, 8, device=DEVICE)]
    y = torch.randn(33, 64, device=DEVICE)
    y_ref = lora_expand_ref(partials, lora_b, slots, y, [0, 24])
    lora_expand(out, lora_b, meta, y, [0, 24])
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_m,dtype", [(16, torch.bfloat16), (32, torch.float32), (64, torch.bfloat16)])
def test_explicit_configs(block_m, dtype):
    """Tiles of every size and programs walking several column tiles, exact and fixed grid."""
    shrink_cfg = LoRAShrinkConfig(block_m=block_m, block_k=32, split_k=2, num_warps=8, num_stages=2)
    for i, (n_tiles, block_n) in enumerate([(1, 16), (2, 16), (4, 32)]):
        run_case(dtype, 8, POPULARITY[(i + block_m // 32) % 4], True, 70, 3, SHAPES[i], seed=block_m + i,
                 fixed_grid=i == 1, split_k=2, shrink_cfg=shrink_cfg,
                 expand_cfg=LoRAExpandConfig(block_m=block_m, block_n=block_n, n_tiles=n_tiles))


@pytest.fixture
def h200_sms(monkeypatch):
    """Plan configs for a 132-SM GPU without one (the config functions are cached: cleared)."""
    import kernels.lora_expand as ke
    import kernels.lora_shrink as ks

    monkeypatch.setattr(ks, "num_sms", lambda device: 132)
    monkeypatch.setattr(ke, "num_sms", lambda device: 132)
    ks.lora_shrink_config.cache_clear()
    ke.lora_expand_config.cache_clear()
    yield 132
    ks.lora_shrink_config.cache_clear()
    ke.lora_expand_config.cache_clear()


LLAMA_LAYERS = [(3, 4096, (4096, 1024, 1024)), (1, 4096, (4096,)), (2, 4096, (14336, 14336)),
                (1, 14336, (4096,))]
"""(slices, in_dim, out_dims) of qkv, o, gate_up, down in Llama-3-8B."""


def test_default_configs_fill_the_gpu(h200_sms):
    """Decode with every slot a one-token segment (the fixed-grid worst case): the programs with
    work are in the band the H200 sweep found fastest (shrink ~8 per SM: split_k 8; expand: per-token
    programs of 512 columns), not hundreds of thousands; split_k never outgrows a reserved buffer."""
    cuda = torch.device("cuda", 0)
    for num_tokens in (1, 64, 256, 4096):
        for segments in (1, 16, 64):
            for slices, in_dim, outs in LLAMA_LAYERS:
                cfg = lora_shrink_config(num_tokens, segments, slices, in_dim, cuda)
                assert cfg.split_k * num_tokens <= shrink_buffer_rows(num_tokens)
                if num_tokens in (64, 256) and segments == 64:
                    tiles = 64 + (num_tokens - 64) // cfg.block_m
                    assert 4 * h200_sms <= tiles * slices * cfg.split_k <= 16 * h200_sms, (cfg, slices)
                    e = lora_expand_config(num_tokens, segments, outs, cuda)
                    cols = e.block_n * e.n_tiles
                    # Per-token programs: one per token and column range (no segment tiles).
                    programs = (num_tokens if e.per_token else tiles) * sum(-(-n // cols) for n in outs)
                    assert 2 * h200_sms <= programs <= 40 * h200_sms, (e, outs)
    # Overrides win; split_k is clamped to what a reserved buffer holds.
    cfg = lora_shrink_config(4096, 4, 1, 4096, cuda, (("block_k", 64), ("split_k", 16)))
    assert cfg.block_k == 64 and cfg.split_k == 1
    assert lora_expand_config(64, 64, (4096,), cuda, (("n_tiles", 2),)).n_tiles == 2


def test_configs_validate_their_fields():
    """Bad launch-config values fail at construction (``KernelPolicy`` builds its lora_shrink /
    lora_expand overrides through these checks)."""
    with pytest.raises(ValueError, match="split_k"):
        LoRAShrinkConfig(split_k=3)
    with pytest.raises(ValueError, match="block_m"):
        LoRAExpandConfig(block_m=8)
    with pytest.raises(ValueError, match="n_tiles"):
        LoRAExpandConfig(n_tiles=64)


def test_split_k_cap_fits_reserved_buffer():
    assert [max_split_k(t) for t in (1, 256, 300, 5000)] == [16, 16, 8, 1]
    rows = [shrink_buffer_rows(t) for t in range(1, 6000)]
    assert rows == sorted(rows)                                        # a reservation fits smaller steps
    assert all(max_split_k(t) * t <= shrink_buffer_rows(t) for t in range(1, 6000))


def test_expand_overwrite_and_spare_columns():
    slots = torch.tensor([1, NO_LORA, 1, 0, 2, 2, 2], dtype=torch.int32, device=DEVICE)
    meta = build_lora_kernel_meta(slots, 3)
    buf = torch.randn(2, 1, 7, 4, device=DEVICE)
    lora_b = [torch.randn(3, 20, 4, device=DEVICE), torch.randn(3, 12, 4, device=DEVICE)]
    y = torch.randn(7, 40, device=DEVICE)
    y_ref = lora_expand_ref(buf, lora_b, slots, y, [5, 25], add_inputs=False)
    lora_expand(buf, lora_b, meta, y, [5, 25], add_inputs=False)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)


def test_no_lora_touches_nothing():
    slots = torch.full((5,), NO_LORA, dtype=torch.int32, device=DEVICE)
    meta = build_lora_kernel_meta(slots, 4)
    assert meta.no_lora and meta.num_active == 0
    out = torch.full((1, 2, 5, 8), 7.0, device=DEVICE)
    lora_shrink(torch.randn(5, 16, device=DEVICE), torch.randn(1, 4, 8, 16, device=DEVICE), meta, out)
    y = torch.randn(5, 16, device=DEVICE)
    y0 = y.clone()
    lora_expand(out, [torch.randn(4, 16, 8, device=DEVICE)], meta, y, [0])
    assert torch.all(out == 7.0) and torch.equal(y, y0)


def test_rejects_bad_inputs():
    slots = torch.tensor([0, 1, NO_LORA], dtype=torch.int32, device=DEVICE)
    meta = build_lora_kernel_meta(slots, 2)
    x, a = torch.randn(3, 16, device=DEVICE), torch.randn(1, 2, 4, 16, device=DEVICE)
    out = torch.zeros(1, 1, 3, 4, device=DEVICE)                                   # [S, split_k, T, rank]
    with pytest.raises(ValueError, match="lora_a: dtype"):
        lora_shrink(x, a.half(), meta, out)
    with pytest.raises(ValueError, match="lora_a: expected shape"):
        lora_shrink(x, torch.randn(1, 2, 4, 8, device=DEVICE), meta, out)
    with pytest.raises(ValueError, match="out: dtype"):
        lora_shrink(x, a, meta, out.half())
    with pytest.raises(ValueError, match="out: expected 4 dims"):
        lora_shrink(x, a, meta, out[:, 0])
    with pytest.raises(ValueError, match="meta: built for 3 tokens"):
        lora_shrink(x[:2], a, meta, out[:, :, :2].contiguous())
    with pytest.raises(ValueError, match="meta: built for max_loras=2"):
        lora_shrink(x, torch.randn(1, 3, 4, 16, device=DEVICE), meta, out)
    with pytest.raises(ValueError, match="split_k"):
        lora_shrink(x, a, meta, torch.zeros(1, 3, 3, 4, device=DEVICE))
    with pytest.raises(ValueError, match=r"config.split_k 2 != out.shape\[1\] 1"):
        lora_shrink(x, a, meta, out, config=LoRAShrinkConfig(split_k=2))
    b, y = [torch.randn(2, 8, 4, device=DEVICE)], torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="exceed"):
        lora_expand(out, b, meta, y, [4])
    with pytest.raises(ValueError, match=r"lora_b_slices\[0\]: dtype"):
        lora_expand(out, [b[0].half()], meta, y, [0])
    with pytest.raises(ValueError, match="buf: expected shape"):
        lora_expand(out, b + b, meta, torch.randn(3, 16, device=DEVICE), [0, 8])
    with pytest.raises(ValueError, match="buf: expected 4 dims"):
        lora_expand(out[:, 0], b, meta, y, [0])
    with pytest.raises(ValueError, match="1..3 tensors"):
        lora_expand(out.expand(4, 1, 3, 4).contiguous(), b * 4, meta, torch.randn(3, 32, device=DEVICE),
                    [0, 8, 16, 24])
    with pytest.raises(ValueError, match="must be contiguous"):
        lora_expand(out, [torch.randn(2, 4, 8, device=DEVICE).transpose(1, 2)], meta, y, [0])


# ----------------------------------------------------------------------------------------
# Meta builder
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("with_base", [False, True])
def test_meta_groups_tokens(popularity, with_base):
    max_loras = 5
    slots = make_slots(40, max_loras, popularity, with_base, seed=7)
    meta = build_lora_kernel_meta(slots, max_loras)
    used = sorted(set(slots.tolist()) - {NO_LORA})
    assert meta.num_active == len(used) and meta.no_lora == (not used)
    assert meta.active_slots.tolist() == used + [-1] * (max_loras - len(used))
    for name in ("sorted_token_ids", "active_slots", "num_tokens_per_slot", "slot_start"):
        assert getattr(meta, name).dtype == torch.int32
    assert meta.sorted_token_ids.shape == (40,) and meta.active_slots.shape == (max_loras,)
    ids = meta.sorted_token_ids.tolist()
    assert sorted(ids) == list(range(40))
    num_lora_tokens = int((slots != NO_LORA).sum())
    for a, slot in enumerate(used):
        start, count = int(meta.slot_start[a]), int(meta.num_tokens_per_slot[a])
        expect = [t for t in range(40) if slots[t] == slot]                 # stable: ascending ids
        assert ids[start:start + count] == expect
    assert ids[num_lora_tokens:] == [t for t in range(40) if slots[t] == NO_LORA]   # base tokens last
    assert meta.num_tokens_per_slot[len(used):].tolist() == [0] * (max_loras - len(used))
    assert meta.slot_start[len(used):].tolist() == [num_lora_tokens] * (max_loras - len(used))
    assert meta.slot_start.tolist() == sorted(meta.slot_start.tolist())   # non-decreasing


def test_meta_small_cases():
    meta = build_lora_kernel_meta(torch.tensor([2, NO_LORA, 0, 2], dtype=torch.int32), 4)
    assert meta.sorted_token_ids.tolist() == [2, 0, 3, 1]
    assert meta.active_slots.tolist() == [0, 2, -1, -1]
    assert meta.num_tokens_per_slot.tolist() == [1, 2, 0, 0]
    assert meta.slot_start.tolist() == [0, 1, 3, 3]
    assert meta.num_active == 2 and not meta.no_lora
    empty = build_lora_kernel_meta(torch.zeros(0, dtype=torch.int32), 2)
    assert empty.no_lora and empty.num_active == 0
    given = build_lora_kernel_meta(torch.tensor([1, 1], dtype=torch.int64), 2, num_active=1)
    assert given.num_active == 1 and given.token_lora_slots.dtype == torch.int32


def test_meta_rejects_bad_slots():
    with pytest.raises(ValueError, match="values must be in"):
        build_lora_kernel_meta(torch.tensor([0, 4], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="values must be in"):
        build_lora_kernel_meta(torch.tensor([-2], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="dtype"):
        build_lora_kernel_meta(torch.tensor([0.0]), 4)
    with pytest.raises(ValueError, match="num_active"):
        build_lora_kernel_meta(torch.tensor([0], dtype=torch.int32), 1, num_active=2)


# ----------------------------------------------------------------------------------------
# GPU: real sizes (Llama-3-8B qkv, 4096 -> 4096 + 1024 + 1024, rank 16)
# ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,max_loras,popularity", [(64, 64, "distinct"), (256, 16, "zipf"),
                                                             (256, 4, "identical"), (1, 4, "uniform")])
def test_gpu_real_sizes(dtype, num_tokens, max_loras, popularity):
    g = torch.Generator().manual_seed(0)
    slots = make_slots(num_tokens, max_loras, popularity, True, seed=1)
    meta = build_lora_kernel_meta(slots, max_loras)
    out_dims = (4096, 1024, 1024)
    x = randn(g, num_tokens, 4096).to(dtype)
    lora_a = (randn(g, 3, max_loras, 16, 4096) / 64).to(dtype)
    lora_b = [(randn(g, max_loras, n, 16) / 4).to(dtype) for n in out_dims]
    split_k = lora_shrink_config(num_tokens, meta.num_active, 3, 4096, DEVICE).split_k
    buf = torch.empty(3, split_k, num_tokens, 16, device=DEVICE)
    lora_shrink(x, lora_a, meta, buf)
    buf_ref = lora_shrink_ref(x, lora_a, slots, split_k=split_k)
    rows = slots != NO_LORA
    torch.testing.assert_close(buf[:, :, rows], buf_ref[:, :, rows], atol=1e-3, rtol=1e-3)
    y0 = randn(g, num_tokens, 6144).to(dtype)
    y_ref = lora_expand_ref(buf_ref, lora_b, slots, y0, [0, 4096, 5120])
    tol = 2 * Y_TOL[dtype]
    for cfg in (None, LoRAExpandConfig(block_n=128, n_tiles=2, per_token=1)):
        y = y0.clone()
        lora_expand(buf, lora_b, meta, y, [0, 4096, 5120], config=cfg)
        torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)


STACKED_CASES = pairwise(DTYPES, POPULARITY, [0, 1])


@pytest.mark.parametrize("dtype,popularity,per_token", STACKED_CASES,
                         ids=[f"{str(d).removeprefix('torch.')}-{p}-{'token' if t else 'segment'}"
                              for d, p, t in STACKED_CASES])
def test_expand_reads_every_slots_shrink(dtype, popularity, per_token):
    """With slot_stride the expand reads token t's h from slot(t)'s columns of a GEMM-shaped
    output holding every slot's shrink (``slotwise_buf``): the same y as the twin on each token's
    own h. The h columns sit after 5 other columns, rows padded: only strides locate them."""
    from kernels.lora_expand import slotwise_buf

    i = STACKED_CASES.index((dtype, popularity, per_token))
    num_tokens, max_loras, rank, out_dims = (1, 7, 33)[i % 3], 4, (1, 8, 16)[i % 3], SHAPES[i % 3][1]
    num_slices = len(out_dims)
    g = torch.Generator().manual_seed(700 + i)
    slots = make_slots(num_tokens, max_loras, popularity, True, 700 + i)
    meta = build_lora_kernel_meta(slots, max_loras, fixed_grid=bool(i % 2))
    h_dtype = torch.float32 if i % 4 == 3 else dtype
    wide = randn(g, num_tokens, 5 + max_loras * num_slices * rank + 3).to(h_dtype)   # [T, 5 | L*S*R | 3]
    h_all = wide[:, 5:5 + max_loras * num_slices * rank].view(num_tokens, max_loras, num_slices, rank)
    buf, slot_stride = slotwise_buf(h_all)                                      # [S, 1, T, R] view
    assert buf.shape == (num_slices, 1, num_tokens, rank) and slot_stride == num_slices * rank
    own = torch.zeros(num_slices, 1, num_tokens, rank, device=DEVICE)           # [S, 1, T, R] f32
    for t, slot in enumerate(slots.tolist()):
        if slot != NO_LORA:
            own[:, 0, t] = h_all[t, slot].float()
    lora_b = [randn(g, max_loras, n, rank).to(dtype) for n in out_dims]
    offsets = [sum(out_dims[:s]) for s in range(num_slices)]
    y = randn(g, num_tokens, sum(out_dims)).to(dtype)
    y_ref = lora_expand_ref(own, lora_b, slots, y, offsets)
    cfg = LoRAExpandConfig(block_n=16, n_tiles=2, per_token=per_token)
    lora_expand(buf, lora_b, meta, y, offsets, config=cfg, slot_stride=slot_stride)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=Y_TOL[dtype], rtol=Y_TOL[dtype])
    with pytest.raises(ValueError, match="slot_stride"):
        lora_expand(buf, lora_b, meta, y, offsets, slot_stride=-1)
    if h_dtype != torch.float32:
        with pytest.raises(ValueError, match="buf"):       # y-dtype h only with a slot stride
            lora_expand(buf, lora_b, meta, y, offsets)
