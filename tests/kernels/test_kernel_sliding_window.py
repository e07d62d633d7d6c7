"""Sliding-window attention and per-token key limits (bidirectional image spans) in every attention path:
the Triton kernels (general, split decode / prefill launches, pure decode with 1-2 KV heads per program,
split-KV, the fused decode rotary) and the engine's torch backend, against the twin
``kernels.reference.paged_attention_ref``.

Blocks entirely before a request's first window are filled with NaN after the twin has run: a path that
read them (rather than masking them after the read) would return NaN, so the tests also show that keys
before the window are never read, as the engine needs once it returns those blocks to the pool.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention import AttentionMetadata, paged_attention_torch
from kernels.cpu_decode_attention import CpuDecodeAttention
from kernels.kv_write import rotary_write_kv
from kernels.paged_attention import paged_attention, paged_decode_rotary
from kernels.reference import paged_attention_ref
from tests.kernels.pairwise import pairwise

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}

LAYOUTS = {
    # (query_len, cached_prefix_len) per request, decodes first (as the runner orders them).
    "decodes": [(1, 40), (1, 7), (1, 0), (1, 70)],
    "mixed": [(1, 30), (1, 64), (5, 37), (20, 0), (9, 50)],
    "prefills": [(13, 0), (24, 21), (3, 60)],
}


def make_step(layout, window, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32,
              seed=0):
    """q, caches, metadata of one step (block 0 reserved as the runner's null block, the others shuffled),
    and the blocks before each request's first window (to poison after the twin ran)."""
    g = torch.Generator().manual_seed(seed)
    qlens = [q for q, _ in layout]
    seq_lens = [q + c for q, c in layout]
    blocks = [max(1, math.ceil(s / block_size)) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).to(torch.int32)
    block_tables = torch.zeros(len(layout), max(blocks), dtype=torch.int32)
    dead: list[int] = []
    used = 0
    for i, (n, (qlen, ctx)) in enumerate(zip(blocks, layout)):
        block_tables[i, :n] = perm[used:used + n]
        used += n
        first_key = max(0, ctx - window + 1) if window else 0
        dead += block_tables[i, :first_key // block_size].tolist()
    q = torch.randn(sum(qlens), num_heads, head_dim, generator=g).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    k_cache[0] = 0.0
    v_cache[0] = 0.0
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    ints = dict(dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(qlens), dtype=torch.int64, device=DEVICE), query_start_loc=qsl.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, **ints), block_tables=block_tables.to(DEVICE),
        max_query_len=max(qlens), max_seq_len=max(seq_lens), num_decode_reqs=sum(1 for n in qlens if n == 1),
        query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens)
    return q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), meta, dead


def image_limits(layout, spans) -> torch.Tensor:
    """key_limit [num_tokens] int32: each token's own position, except tokens of ``spans`` ((request,
    first position, end position) each, within the request's chunk) see up to their span's last token."""
    limits: list[int] = []
    for qlen, ctx in layout:
        limits += list(range(ctx, ctx + qlen))
    starts = [0]
    for qlen, _ in layout:
        starts.append(starts[-1] + qlen)
    for req, first, end in spans:
        ctx = layout[req][1]
        for pos in range(first, end):
            limits[starts[req] + pos - ctx] = end - 1
    return torch.tensor(limits, dtype=torch.int32, device=DEVICE)


def poison(k_cache, v_cache, dead) -> None:
    for b in dead:
        k_cache[b] = float("nan")
        v_cache[b] = float("nan")


def twin(q, k_cache, v_cache, meta, scale, window, key_limit=None):
    return paged_attention_ref(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
                               window=window, key_limit=key_limit)


def kernel(q, k_cache, v_cache, meta, scale, **kw):
    return paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                           meta.max_query_len, meta.max_seq_len, scale, **kw)


def assert_close(actual, expected, dtype):
    assert not actual.isnan().any(), "read a key before its window"
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


LAUNCHES = [(layout, path) for layout in LAYOUTS for path in (
    ["one_launch", "split_launches"] + (["split_kv", "decode_1", "decode_2"] if layout == "decodes" else []))]
"""(layout, launch variant) of the kernel tests."""


@pytest.mark.parametrize("layout,path,window",
                         [(*launch, window) for i, launch in enumerate(LAUNCHES)
                          for window in ((1, 16), (5, 33))[i % 2]])
def test_kernel_window_matches_twin(layout, window, path):
    """Each launch variant under a window within one block (1 key or 5) and one of a block or across blocks
    (16 or 33)."""
    q, kc, vc, meta, dead = make_step(LAYOUTS[layout], window, seed=window)
    scale = 32 ** -0.5
    expected = twin(q, kc, vc, meta, scale, window)
    poison(kc, vc, dead)
    kw = {"one_launch": dict(split_decodes=False), "split_launches": dict(split_decodes=True),
          "split_kv": dict(num_splits=4), "decode_1": dict(num_splits=1, decode_tiles={"heads_per_prog": 1}),
          "decode_2": dict(num_splits=1, decode_tiles={"heads_per_prog": 2})}[path]
    assert_close(kernel(q, kc, vc, meta, scale, window=window, **kw), expected, torch.float32)


@pytest.mark.parametrize("window,dtype", [(None, torch.float32), (6, torch.bfloat16), (40, torch.float32)])
def test_kernel_image_spans_with_window(window, dtype):
    """Tokens of an image span see the whole span (also later keys), text tokens stay causal; a chunk may
    start inside a span whose first part is cached; the window still applies."""
    layout = LAYOUTS["mixed"]
    spans = [(2, 38, 41), (3, 4, 12), (3, 15, 16), (4, 50, 58)]   # request 2 starts mid-span at 37
    limits = image_limits(layout, spans)
    q, kc, vc, meta, dead = make_step(layout, window, dtype=dtype, seed=3)
    expected = twin(q, kc, vc, meta, 0.2, window, limits)
    causal = twin(q, kc, vc, meta, 0.2, window)
    assert not torch.allclose(expected.float(), causal.float(), atol=1e-3), "the spans change the result"
    poison(kc, vc, dead)
    for split in (False, True):
        assert_close(kernel(q, kc, vc, meta, 0.2, window=window, key_limit=limits, split_decodes=split),
                     expected, dtype)


@pytest.mark.parametrize("window,num_splits", [(3, 1), (16, 4), (29, 1), (29, 4)])
def test_fused_decode_rotary_window(window, num_splits):
    """The fused rotary + KV write + decode kernel attends to the window only (its newest key from registers)."""
    layout = LAYOUTS["decodes"]
    q, kc, vc, meta, dead = make_step(layout, window, seed=11)
    n, hkv, d = q.shape[0], kc.shape[2], kc.shape[3]
    g = torch.Generator().manual_seed(5)
    k = torch.randn(n, hkv, d, generator=g).to(DEVICE)
    v = torch.randn(n, hkv, d, generator=g).to(DEVICE)
    seq = meta.seq_lens.long()
    positions = seq - 1
    bs = kc.shape[1]
    slots = meta.block_tables.gather(1, (positions // bs)[:, None]).squeeze(1).long() * bs + positions % bs
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.arange(128, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    kc2, vc2, q2 = kc.clone(), vc.clone(), q.clone()
    rotary_write_kv(positions, q2, k.clone(), v, cos, sin, d, kc2, vc2, slots)
    expected = twin(q2, kc2, vc2, meta, 0.25, window)
    poison(kc, vc, dead)
    out = paged_decode_rotary(q, k, v, positions, cos, sin, d, kc, vc, slots, meta.query_start_loc, meta.seq_lens,
                              meta.block_tables, meta.max_seq_len, 0.25, num_splits=num_splits, window=window)
    assert_close(out, expected, torch.float32)


@pytest.fixture(scope="module")
def cpu_decode(tmp_path_factory):
    kernel = CpuDecodeAttention.load(tmp_path_factory.mktemp("cpu_kernels"), 32)
    assert kernel is not None, "the C kernel did not build (is gcc installed?)"
    return kernel


@pytest.mark.parametrize("layout,window,mode", pairwise(list(LAYOUTS), [1, 7, 16, 45],
                                                       ["cache", "new_kv", "c_decode"]))
def test_torch_backend_window_matches_twin(layout, window, mode, cpu_decode):
    """The engine's CPU path: windowed decodes (gathered by window, or through the C decode kernel), masked
    chunks over their window's blocks (from the cache, or this step's K/V for a chunk with no prefix);
    every pair of layout, window and mode."""
    with_new_kv, c_decode = mode == "new_kv", mode == "c_decode"
    if c_decode and DEVICE.type != "cpu":
        pytest.skip("the C decode kernel reads host tensors")
    rows = LAYOUTS[layout]
    q, kc, vc, meta, dead = make_step(rows, window, seed=window + 1)
    expected = twin(q, kc, vc, meta, 0.3, window)
    k_new = v_new = None
    if with_new_kv:   # this step's K/V rows, as the layer passes them (the cache already holds them)
        bs = kc.shape[1]
        pos = torch.cat([torch.arange(c, c + n) for n, c in rows]).to(DEVICE)
        req = torch.repeat_interleave(torch.arange(len(rows), device=DEVICE),
                                      torch.tensor([n for n, _ in rows], device=DEVICE))
        blk = meta.block_tables[req, pos // bs].long()
        k_new, v_new = kc[blk, pos % bs].clone(), vc[blk, pos % bs].clone()
    poison(kc, vc, dead)
    out = paged_attention_torch(q, kc, vc, meta, 0.3, k_new, v_new, decode_kernel=cpu_decode if c_decode else None,
                                window=window)
    assert_close(out, expected, torch.float32)


def test_torch_backend_image_spans():
    layout = LAYOUTS["mixed"]
    limits = image_limits(layout, [(2, 38, 41), (3, 4, 12), (4, 50, 58)])
    q, kc, vc, meta, _ = make_step(layout, None, seed=4)
    meta.key_limit = limits
    for window in (None, 9):
        expected = twin(q, kc, vc, meta, 0.3, window, limits)
        assert_close(paged_attention_torch(q, kc, vc, meta, 0.3, window=window), expected, torch.float32)


def test_rejects_bad_window_and_limits():
    q, kc, vc, meta, _ = make_step(LAYOUTS["mixed"], None)
    with pytest.raises(ValueError, match="window"):
        kernel(q, kc, vc, meta, 0.3, window=0)
    with pytest.raises(ValueError, match="key_limit"):
        kernel(q, kc, vc, meta, 0.3, key_limit=torch.zeros(3, dtype=torch.int32, device=DEVICE))
