"""The o/down LoRA expand fused into add + RMSNorm (``kernels.lora_expand_norm``) against its twin
(expand, then add + RMSNorm), on CPU through the interpreter; real sizes on CUDA."""

from __future__ import annotations

import pytest
import torch

from kernels.lora_expand import slotwise_buf
from kernels.lora_expand_norm import lora_expand_add_rms_norm
from kernels.lora_meta import build_lora_kernel_meta
from kernels.reference import lora_expand_add_rms_norm_ref
from tests.kernels.test_kernel_lora import DEVICE
from tests.kernels.pairwise import pairwise

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
       torch.float16: dict(atol=4e-3, rtol=4e-3)}


def meta_of(slots: torch.Tensor, max_loras: int):
    return build_lora_kernel_meta(slots, max_loras)


def run_case(dtype, hidden, with_residual, slotwise, num_tokens=7, rank=8, max_loras=3, seed=0, tiles=False,
             slot_of=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden + 5, generator=g).to(dtype).to(DEVICE)[:, :hidden]   # strided rows
    residual = torch.randn(num_tokens, hidden, generator=g).to(dtype).to(DEVICE) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    slot_of = slot_of or (lambda i: (i % (max_loras + 1)) - 1)                   # -1 (base), 0, 1, 2, ...
    lslots = torch.tensor([slot_of(i) for i in range(num_tokens)], dtype=torch.int32, device=DEVICE)
    lora_b = (torch.randn(max_loras, hidden, rank, generator=g) / rank).to(dtype).to(DEVICE)
    h_all = torch.randn(num_tokens, max_loras, 1, rank, generator=g).to(DEVICE)
    own = torch.zeros(1, 1, num_tokens, rank, device=DEVICE)
    for t, s in enumerate(lslots.tolist()):
        if s >= 0:
            own[:, 0, t] = h_all[t, s]
    want_out, want_s = lora_expand_add_rms_norm_ref(own, lora_b, lslots, x, weight, 1e-5, residual)
    buf, slot_stride = slotwise_buf(h_all) if slotwise else (torch.cat([own * 0.5, own * 0.5], dim=1), 0)
    x0 = x.clone()
    out = lora_expand_add_rms_norm(buf, lora_b, meta_of(lslots, max_loras), x, weight, 1e-5, residual=residual,
                                   slot_stride=slot_stride, tiles=tiles)
    stored = residual if with_residual else x
    return out, stored, want_out, want_s, x, x0


@pytest.mark.parametrize("dtype,hidden,form,tiles",
                         pairwise([torch.float32, torch.bfloat16, torch.float16], [64, 100, 3000, 8192],
                                  ["residual-slotwise", "no-residual-partials", "residual-partials"],
                                  ["per-row", "tiles"]))
def test_matches_ref(dtype, hidden, form, tiles):
    """Rows updated, summed (stored into residual, or x without one) and normalized; base-model rows
    (slot -1) get the plain add + RMSNorm; odd widths and rows wider than one piece (8192); both
    launch shapes (per-row programs, segment tiles); every pair of dtype, width, form and launch shape."""
    with_residual, slotwise = form.startswith("residual"), form.endswith("slotwise")
    tiles = tiles == "tiles"
    out, stored, want_out, want_s, x, x0 = run_case(dtype, hidden, with_residual, slotwise, tiles=tiles)
    torch.testing.assert_close(stored.float(), want_s.float(), **TOL[dtype])
    torch.testing.assert_close(out.float(), want_out.float(), **TOL[dtype])
    if with_residual:
        assert torch.equal(x, x0)                                   # x only read when there is a residual


@pytest.mark.parametrize("dtype,slots", [(torch.float32, "prefill"), (torch.bfloat16, "one-adapter"),
                                         (torch.float32, "all-base"), (torch.bfloat16, "padded-segments")])
def test_tiles_over_segments(dtype, slots):
    """Segment tiles over prefill-like steps: segments longer than a tile and ending mid-tile
    (40 / 17 / 3 rows), interleaved rows of one adapter, base rows only, and empty slots between
    used ones (slot 4 of 6 unused)."""
    pattern = {"prefill": lambda i: 0 if i < 40 else (2 if i < 57 else (5 if i < 60 else -1)),
               "one-adapter": lambda i: 3 if i % 2 else -1,
               "all-base": lambda i: -1,
               "padded-segments": lambda i: [0, 5, 1, 5, -1][i % 5]}[slots]
    out, stored, want_out, want_s, _, _ = run_case(dtype, 48, True, True, num_tokens=67, max_loras=6,
                                                   tiles=True, slot_of=pattern)
    torch.testing.assert_close(stored.float(), want_s.float(), **TOL[dtype])
    torch.testing.assert_close(out.float(), want_out.float(), **TOL[dtype])


def test_row_launch_by_rank():
    """Per-row programs: rank 16 (block_r 16) keeps the measured launch (the whole row up to 4096
    columns, 16 warps at 4096, one warp per 256 columns below); larger ranks load narrower pieces
    with the same B elements per thread instead of spilling registers."""
    from kernels.lora_expand_norm import row_launch

    assert row_launch(4096, 16) == (4096, 16) and row_launch(8192, 16) == (4096, 16)
    assert row_launch(896, 16) == (1024, 4) and row_launch(64, 16) == (64, 1)
    assert row_launch(4096, 32) == (2048, 16) and row_launch(4096, 64) == (1024, 16)
    assert row_launch(8192, 256) == (256, 16) and row_launch(100, 64) == (128, 2)


@pytest.mark.parametrize("tiles", [False, True], ids=["per-row", "tiles"])
def test_high_rank_rows_over_pieces(tiles):
    """Rank 72 (padded to 128): the per-row programs' default pieces are 512 columns, so a 600-column
    row takes two; same result as the reference (and the tile programs)."""
    out, stored, want_out, want_s, *_ = run_case(torch.float32, 600, True, True, num_tokens=5, rank=72,
                                                 tiles=tiles)
    torch.testing.assert_close(stored, want_s, **TOL[torch.float32])
    torch.testing.assert_close(out, want_out, **TOL[torch.float32])


def test_launch_shape_by_size(monkeypatch):
    """Steps of at most PER_ROW_MAX_TOKENS rows launch the per-row programs, larger ones the tiles;
    both give the twin's result."""
    from kernels import lora_expand_norm as m

    launched = []

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    monkeypatch.setattr(m, "PER_ROW_MAX_TOKENS", 8)
    monkeypatch.setattr(m, "_lora_expand_add_rms_norm_kernel", Spy("per-row", m._lora_expand_add_rms_norm_kernel))
    monkeypatch.setattr(m, "_lora_expand_add_rms_norm_tile_kernel",
                        Spy("tiles", m._lora_expand_add_rms_norm_tile_kernel))
    for num_tokens in (8, 9):
        out, _, want_out, _, _, _ = run_case(torch.float32, 32, True, False, num_tokens=num_tokens, tiles=None)
        torch.testing.assert_close(out, want_out, **TOL[torch.float32])
    assert launched == ["per-row", "tiles"]


def test_fuses_where_measured_faster():
    """The engine fuses decode-sized steps (per-row programs) and long prefill steps (tiles), and
    leaves the sizes between, where the expand + add_rms_norm pair measured faster, unfused."""
    from kernels.lora_expand_norm import PER_ROW_MAX_TOKENS, TILES_MIN_TOKENS, fuses

    assert [fuses(t) for t in (0, 1, PER_ROW_MAX_TOKENS, PER_ROW_MAX_TOKENS + 1, TILES_MIN_TOKENS - 1,
                                TILES_MIN_TOKENS, 16384)] == [False, True, True, False, False, True, True]


def test_update_is_added():
    """Base rows equal plain add_rms_norm; a LoRA row is x + h . B before the norm (h . B = 4 here)."""
    from kernels.layer_ops import add_rms_norm

    x = torch.randn(2, 16, device=DEVICE)
    residual = torch.randn(2, 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    b = torch.ones(1, 16, 4, device=DEVICE)
    slots = torch.tensor([-1, 0], dtype=torch.int32, device=DEVICE)
    want_r = residual.clone()
    want = add_rms_norm(x + torch.tensor([[0.0], [4.0]], device=DEVICE), w, 1e-5, residual=want_r)
    r = residual.clone()
    out = lora_expand_add_rms_norm(torch.ones(1, 1, 2, 4, device=DEVICE), b, meta_of(slots, 1), x, w, 1e-5,
                                   residual=r)
    torch.testing.assert_close(r, want_r)
    torch.testing.assert_close(out, want)


def test_rejects_bad_inputs():
    x = torch.randn(2, 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    b = torch.ones(1, 16, 4, device=DEVICE)
    meta = meta_of(torch.tensor([-1, 0], dtype=torch.int32, device=DEVICE), 1)
    with pytest.raises(ValueError, match="buf"):
        lora_expand_add_rms_norm(torch.ones(2, 1, 2, 4, device=DEVICE), b, meta, x, w, 1e-5)
    with pytest.raises(ValueError, match="lora_b"):
        lora_expand_add_rms_norm(torch.ones(1, 1, 2, 4, device=DEVICE), b[:, :8], meta, x, w, 1e-5)
    with pytest.raises(ValueError, match="meta"):
        lora_expand_add_rms_norm(torch.ones(1, 1, 2, 4, device=DEVICE), b, meta_of(meta.token_lora_slots, 2),
                                 x, w, 1e-5)
    with pytest.raises(ValueError, match="block_m"):
        lora_expand_add_rms_norm(torch.ones(1, 1, 2, 4, device=DEVICE), b, meta, x, w, 1e-5, tiles=True,
                                 block_m=24)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("slotwise,num_tokens", [(True, 64), (False, 64), (False, 1000)])
def test_gpu_llama3_sizes(slotwise, num_tokens):
    """Llama-3-8B hidden (4096), 64 decode rows (per-row programs) or 1000 prefill rows (tiles) over
    3 adapters and the base model, rank 16, bf16."""
    pattern = None if num_tokens <= 128 else (lambda i: min(i // 300, 3) - 1)
    out, stored, want_out, want_s, _, _ = run_case(torch.bfloat16, 4096, True, slotwise, num_tokens=num_tokens,
                                                   rank=16, tiles=None, slot_of=pattern)
    torch.testing.assert_close(stored.float(), want_s.float(), **TOL[torch.bfloat16])
    torch.testing.assert_close(out.float(), want_out.float(), **TOL[torch.bfloat16])
