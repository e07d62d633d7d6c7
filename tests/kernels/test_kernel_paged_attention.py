"""Paged attention: the Triton kernel and the engine's torch backend against the simple twin.

Batches mix prefill chunks (with and without a cached prefix) and decodes in any order,
with shuffled block ids so the block-table gather is exercised. Under TRITON_INTERPRET=1
the grids stay tiny (a few requests, 2 KV heads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from engine.attention import AttentionMetadata, paged_attention_torch
from kernels.paged_attention import find_chunk, paged_attention
from kernels.reference import paged_attention_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""CPU tensors run the kernels through the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
"""atol = rtol per dtype (outputs are O(1); bf16 keeps 8 mantissa bits)."""

LAYOUTS = {
    # (query_len, cached_prefix_len) per request, in batch order.
    "decodes": [(1, 40), (1, 7), (1, 0), (1, 65)],
    "prefills": [(13, 0), (9, 21)],
    "mixed": [(1, 30), (5, 7), (1, 64), (20, 0)],
    "mixed_decodes_last": [(6, 33), (3, 0), (1, 15), (1, 1)],
}


@dataclass
class AttnBatch:
    """One step's attention inputs (all on CPU unless moved)."""

    q: torch.Tensor                 # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor           # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor   # [num_reqs + 1] int32
    seq_lens: torch.Tensor          # [num_reqs] int32
    block_tables: torch.Tensor      # [num_reqs, max_blocks] int32
    max_query_len: int
    max_seq_len: int

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens, self.block_tables)

    def to(self, device) -> "AttnBatch":
        return AttnBatch(*(t.to(device) for t in self.args()), self.max_query_len, self.max_seq_len)


def make_batch(layout, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32,
               seed=0, pad_tokens=0) -> AttnBatch:
    g = torch.Generator().manual_seed(seed)
    qlens = [q for q, _ in layout]
    seq_lens = [q + c for q, c in layout]
    blocks = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 2                                      # spare blocks hold noise
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    block_tables = torch.zeros(len(layout), max(max(blocks), 1), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        block_tables[i, :n] = perm[used:used + n]
        used += n
    num_tokens = sum(qlens) + pad_tokens
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    return AttnBatch(q, k_cache, v_cache, qsl, torch.tensor(seq_lens, dtype=torch.int32), block_tables,
                     max(qlens), max(seq_lens)).to(DEVICE)


def run_kernel(b: AttnBatch, scale: float, **kw) -> torch.Tensor:
    return paged_attention(*b.args(), b.max_query_len, b.max_seq_len, scale, **kw)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("layout,dtype", [
    ("decodes", torch.float32), ("decodes", torch.float16), ("decodes", torch.bfloat16),   # paged_decode
    ("prefills", torch.float32), ("mixed", torch.float16), ("mixed_decodes_last", torch.bfloat16)])
def test_matches_ref_per_layout(layout, dtype):
    """Every dtype on the pure-decode kernel and on the general kernel, every layout."""
    b = make_batch(LAYOUTS[layout], dtype=dtype)
    scale = 32 ** -0.5
    out = run_kernel(b, scale)
    assert out.dtype == dtype and out.shape == b.q.shape
    assert_close(out, paged_attention_ref(*b.args(), scale), dtype)


@pytest.mark.parametrize("head_dim", [16, 80, 128])
def test_head_sizes(head_dim):
    """Powers of two (16, 128) and a head dim padded to one (80: 128-wide loads, masked)."""
    b = make_batch(LAYOUTS["mixed"], head_dim=head_dim, dtype=torch.float16, seed=head_dim)
    scale = head_dim ** -0.5
    assert_close(run_kernel(b, scale), paged_attention_ref(*b.args(), scale), torch.float16)


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads",
                         [(16, 4, 4), (32, 4, 2), (64, 6, 2), (16, 4, 1), (32, 32, 1), (64, 4, 4)])
def test_block_sizes_and_gqa(block_size, num_heads, num_kv_heads):
    """Every GQA group size (1, 2, 3, 4, 32) and every block size."""
    b = make_batch([(1, 50), (7, 20)], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16,
                   block_size=block_size, seed=block_size + num_heads)
    assert_close(run_kernel(b, 0.25), paged_attention_ref(*b.args(), 0.25), torch.float32)


# (num_heads, num_kv_heads, head_dim, block_size, heads_per_prog): every shape once, 0 (the general
# kernel) and 1, 2, 4 KV heads per program on shapes whose KV heads they divide, and 4 on 2 and on 1 KV
# heads (a count the KV heads do not divide is halved until it does: the clamp).
PURE_DECODE_CASES = [(8, 4, 32, 16, 4), (12, 4, 80, 16, 2), (4, 1, 16, 32, 4), (6, 2, 64, 64, 0),
                     (8, 8, 16, 16, 1), (8, 8, 16, 16, 4), (4, 2, 256, 16, 4), (32, 1, 16, 16, 0)]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,heads_per_prog", PURE_DECODE_CASES)
def test_pure_decode_kernel(heads_per_prog, num_heads, num_kv_heads, head_dim, block_size):
    """Pure-decode batches run kernels.paged_decode with 1-4 KV heads per program (one loop over
    (head, tile) pairs; fewer where the heads do not divide), or the general kernel (0); contexts
    of 1 key, at and across block and tile edges, head dims padded to a power of two. One KV
    segment (num_splits=1): on a GPU a batch this small would otherwise split the KV work and take
    the split-KV launches instead."""
    import kernels.paged_attention as pa

    layout = [(1, c) for c in (0, 31, 32, 33, 95, 6, block_size - 1, 2 * block_size)]
    b = make_batch(layout, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   block_size=block_size, dtype=torch.bfloat16, seed=heads_per_prog + head_dim)
    scale = head_dim ** -0.5
    cfg = pa._choose_config(b.q.device, num_heads // num_kv_heads, head_dim, len(layout), num_kv_heads, 1,
                            b.max_seq_len, 1, {"heads_per_prog": heads_per_prog}, pure_decode=True)
    assert cfg.heads_per_prog == (0 if heads_per_prog == 0 else math.gcd(heads_per_prog, num_kv_heads))
    out = run_kernel(b, scale, decode_tiles={"heads_per_prog": heads_per_prog}, num_splits=1)
    assert_close(out, paged_attention_ref(*b.args(), scale), torch.bfloat16)


@pytest.mark.parametrize("num_reqs,want", [(256, "small"), (99, "small"), (98, "default"), (32, "default")])
def test_pure_decode_tiles_by_waves_of_programs(num_reqs, want, monkeypatch):
    """On a GPU (an H200's 132 SMs, Llama-3-8B's 8 KV heads) pure-decode batches of >= 6 waves of
    programs take one warp, 32 keys, 3 stages; smaller ones 64 keys / 2 warps; overrides win."""
    import kernels.paged_attention as pa

    monkeypatch.setattr(pa, "is_interpreted", lambda device: False)
    monkeypatch.setattr(pa, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    cfg = pa._choose_config(cuda, 4, 128, num_reqs, 8, 1, 534, None, None, pure_decode=True)
    tiles = pa.SMALL_DECODE_TILES if want == "small" else pa.DECODE_TILES
    assert (cfg.tile_n, cfg.num_warps, cfg.num_stages, cfg.num_splits, cfg.heads_per_prog) == (*tiles, 1, 1)
    assert pa.SMALL_DECODE_TILES == (32, 1, 3) and pa.DECODE_TILES == (64, 2, 3)
    assert pa.min_reqs_for_small_decode_tiles(cuda, 8) == 99
    cfg = pa._choose_config(cuda, 4, 128, num_reqs, 8, 1, 534, None, {"num_warps": 4}, pure_decode=True)
    assert cfg.num_warps == 4


@pytest.mark.parametrize("heads_first", [0, 1])
def test_grid_orders_of_the_general_kernel(heads_first):
    """KV heads on grid axis 0 (default) or the q-blocks: the same rows either way."""
    b = make_batch(LAYOUTS["decodes"], head_dim=16, pad_tokens=1)   # padding: not pure decode
    n = int(b.query_start_loc[-1])
    out = run_kernel(b, 0.25, decode_tiles={"heads_first": heads_first})
    assert_close(out[:n], paged_attention_ref(*b.args(), 0.25)[:n], torch.float32)


def test_pure_decode_kernel_only_for_one_token_per_row(monkeypatch):
    """The decode kernel takes row i as request i: padding rows past the requests, or a batch
    whose max_query_len exceeds 1, go to the general kernel (one KV segment, as on a GPU a batch
    this small would otherwise split)."""
    import kernels.paged_attention as pa

    used = []
    decode = pa.launch_paged_decode
    monkeypatch.setattr(pa, "launch_paged_decode", lambda *a, **kw: used.append(1) or decode(*a, **kw))
    b = make_batch(LAYOUTS["decodes"], head_dim=16, pad_tokens=2)
    run_kernel(b, 0.25, num_splits=1)
    assert used == []
    b = make_batch(LAYOUTS["decodes"], head_dim=16)
    assert_close(run_kernel(b, 0.25, num_splits=1), paged_attention_ref(*b.args(), 0.25), torch.float32)
    assert used == [1]


@pytest.mark.parametrize("layout,num_splits", [("decodes", 2), ("decodes", 8), ("mixed", 4)])
def test_split_kv(layout, num_splits):
    """Flash-decoding path: partials per KV segment merged by the second kernel (empty
    segments included: 8 splits over <= 3 tiles)."""
    b = make_batch(LAYOUTS[layout], head_dim=16, dtype=torch.float16, seed=num_splits)
    assert_close(run_kernel(b, 0.25, num_splits=num_splits), paged_attention_ref(*b.args(), 0.25),
                 torch.float16)


@pytest.mark.parametrize("layout,dtype", [("mixed", torch.float32), ("mixed_decodes_last", torch.bfloat16),
                                          ("decodes", torch.bfloat16), ("prefills", torch.float32)])
def test_split_decode_and_prefill_launches(layout, dtype):
    """A batch with prefill chunks split into a one-program-per-request decode launch and a
    prefill launch that skips one-token requests: together they cover every row, in any order."""
    b = make_batch(LAYOUTS[layout], head_dim=16, dtype=dtype, seed=3, pad_tokens=2)
    n = int(b.query_start_loc[-1])
    ref = paged_attention_ref(*b.args(), 0.25)[:n]
    max_q = max(b.max_query_len, 2)      # a pure-decode layout is sent down the split path too
    out = paged_attention(*b.args(), max_q, b.max_seq_len, 0.25, split_decodes=True)
    assert_close(out[:n], ref, dtype)
    if layout == "prefills":   # no one-token request: the decode launch may be skipped
        out = paged_attention(*b.args(), max_q, b.max_seq_len, 0.25, split_decodes=True, has_decodes=False)
        assert_close(out[:n], ref, dtype)


def test_split_launches_each_cover_only_their_rows():
    """The decode launch alone writes exactly the one-token requests' rows, the prefill launch
    (has_decodes=False) exactly the others'."""
    b = make_batch(LAYOUTS["mixed"], head_dim=16, seed=5)
    qlens = [q for q, _ in LAYOUTS["mixed"]]
    starts = [0] + torch.tensor(qlens).cumsum(0).tolist()
    decode_rows = [starts[i] for i, q in enumerate(qlens) if q == 1]
    out = torch.full_like(b.q, float("nan"))
    paged_attention(*b.args(), b.max_query_len, b.max_seq_len, 0.25, out=out, split_decodes=True,
                    has_decodes=False)
    written = ~torch.isnan(out[:, 0, 0]).cpu()
    assert written.sum() == sum(q for q in qlens if q > 1)
    assert not written[decode_rows].any()


def test_padding_tokens_and_out_argument():
    """Rows past qsl[-1] (CUDA-graph padding) are ignored; ``out`` is filled and returned."""
    b = make_batch(LAYOUTS["mixed"], pad_tokens=3)
    out = torch.zeros_like(b.q)
    ret = run_kernel(b, 0.2, out=out)
    assert ret is out
    n = int(b.query_start_loc[-1])
    assert_close(out[:n], paged_attention_ref(*b.args(), 0.2)[:n], torch.float32)


def test_strided_q_view_of_fused_qkv():
    """q may be a view into a packed qkv output (token stride > num_heads * head_dim)."""
    b = make_batch(LAYOUTS["mixed"], head_dim=16)
    qkv = torch.randn(b.q.shape[0], 4 * 16 + 2 * 2 * 16, device=DEVICE)
    qkv[:, :64] = b.q.reshape(-1, 64)
    q_view = qkv[:, :64].view(-1, 4, 16)
    assert not q_view.is_contiguous()
    out = paged_attention(q_view, *b.args()[1:], b.max_query_len, b.max_seq_len, 0.25)
    assert_close(out, paged_attention_ref(*b.args(), 0.25), torch.float32)


@pytest.mark.parametrize("layout", ["mixed", "decodes"])
def test_head_major_cache_view(layout):
    """A cache stored [block, KV head, slot, dim] and passed as its [block, slot, head, dim]
    permuted view reads the same keys and values as the contiguous layout."""
    b = make_batch(LAYOUTS[layout], head_dim=16)
    q, kc, vc, qsl, sl, bt = b.args()
    kh, vh = (c.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for c in (kc, vc))
    assert not kh.is_contiguous() and torch.equal(kh, kc)
    out = paged_attention(q, kh, vh, qsl, sl, bt, b.max_query_len, b.max_seq_len, 0.25)
    assert_close(out, paged_attention_ref(*b.args(), 0.25), torch.float32)


def test_empty_request_in_batch():
    """A request with zero query tokens this step owns no rows and must not disturb others."""
    b = make_batch([(3, 5), (1, 9)], head_dim=16)
    qsl = torch.tensor([0, 3, 3, 4], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([8, 4, 10], dtype=torch.int32, device=DEVICE)
    bt = torch.cat([b.block_tables[:1], b.block_tables[:1], b.block_tables[1:]])
    args = (b.q, b.k_cache, b.v_cache, qsl, seq_lens, bt)
    out = paged_attention(*args, 3, 10, 0.25)
    assert_close(out, paged_attention_ref(*args, 0.25), torch.float32)


# ----------------------------------------------------------------------------------------
# engine.attention.paged_attention_torch (the CPU backend) against the same twin
# ----------------------------------------------------------------------------------------
def engine_meta(b: AttnBatch, layout) -> AttentionMetadata:
    num_decode_reqs = 0
    for qlen, _ in layout:                       # NOTE: the runner puts decodes first
        if qlen != 1:
            break
        num_decode_reqs += 1
    slot_mapping = torch.zeros(b.q.shape[0], dtype=torch.int64, device=DEVICE)   # unused by attention
    return AttentionMetadata(slot_mapping=slot_mapping, query_start_loc=b.query_start_loc,
                             seq_lens=b.seq_lens, block_tables=b.block_tables,
                             max_query_len=b.max_query_len, max_seq_len=b.max_seq_len,
                             num_decode_reqs=num_decode_reqs)


@pytest.mark.parametrize("layout,dtype", [("decodes", torch.float32), ("prefills", torch.bfloat16),
                                          ("mixed", torch.bfloat16), ("mixed_decodes_last", torch.float32)])
def test_engine_torch_backend_matches_ref(layout, dtype):
    rows = LAYOUTS[layout]
    if layout == "mixed":                        # decodes first, as the runner orders them
        rows = sorted(rows, key=lambda r: r[0] != 1)
    b = make_batch(rows, num_heads=6, num_kv_heads=2, dtype=dtype)
    scale = 32 ** -0.5
    out = paged_attention_torch(b.q, b.k_cache, b.v_cache, engine_meta(b, rows), scale)
    assert_close(out, paged_attention_ref(*b.args(), scale), dtype)


# ----------------------------------------------------------------------------------------
# Wrapper checks
# ----------------------------------------------------------------------------------------
def test_rejects_bad_inputs():
    b = make_batch(LAYOUTS["mixed"], head_dim=16)
    q, kc, vc, qsl, sl, bt = b.args()
    call = lambda *a, **kw: paged_attention(*a, b.max_query_len, b.max_seq_len, 0.25, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="k_cache: dtype"):
        call(q, kc.half(), vc, qsl, sl, bt)
    with pytest.raises(ValueError, match="v_cache: strides"):
        call(q, kc, vc.transpose(0, 1).contiguous().transpose(0, 1), qsl, sl, bt)
    with pytest.raises(ValueError, match="k_cache: last dim must have stride 1"):
        call(q, kc.transpose(-1, -2).contiguous().transpose(-1, -2), vc, qsl, sl, bt)
    with pytest.raises(ValueError, match="query_start_loc: dtype"):
        call(q, kc, vc, qsl.long(), sl, bt)
    with pytest.raises(ValueError, match="seq_lens: expected shape"):
        call(q, kc, vc, qsl, sl[:-1], bt)
    with pytest.raises(ValueError, match="num_kv_heads"):
        call(q[:, :3], kc, vc, qsl, sl, bt)
    with pytest.raises(ValueError, match="k_cache: expected shape"):
        call(q[..., :8], kc, vc, qsl, sl, bt)
    with pytest.raises(ValueError, match="num_splits"):
        call(q, kc, vc, qsl, sl, bt, num_splits=3)
    with pytest.raises(ValueError, match="q: last dim"):
        call(q.transpose(1, 2).contiguous().transpose(1, 2), kc, vc, qsl, sl, bt)
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention(q, kc, vc, qsl, sl, bt[:, :1], b.max_query_len, b.max_seq_len, 0.25)


def test_warm_up_runs_every_eager_variant_and_leaves_the_cache_alone(monkeypatch):
    """``AttentionBackend.warm_up`` (start-up compile of the eager-step variants): one attention
    call per (request count, longest query, decodes or not) case, on both ``find_chunk`` widths,
    reading the cache only; with the model's rotary_dim but a policy without the fused decode
    rotary (``decode_fuse_rotary="0"``) no fused launch; the torch backend does nothing."""
    import kernels.paged_attention as pa
    from engine.attention import AttentionBackend
    from engine.kernel_policy import KernelPolicy

    launches = []
    launch = pa._launch
    monkeypatch.setattr(pa, "_launch", lambda *a: launches.append((a[4].shape[0], a[-2], a[-1])) or launch(*a))
    decode_launches = []   # pure-decode calls take kernels.paged_decode
    decode = pa.launch_paged_decode
    monkeypatch.setattr(pa, "launch_paged_decode",
                        lambda *a, **kw: decode_launches.append(a[3].shape[0]) or decode(*a, **kw))
    fused = []
    rotary = pa.paged_decode_rotary
    monkeypatch.setattr(pa, "paged_decode_rotary",
                        lambda *a, **kw: fused.append(a[0].shape[0]) or rotary(*a, **kw))
    kc = torch.randn(3, 16, 2, 32, device=DEVICE, dtype=torch.float16 if DEVICE.type == "cuda" else torch.float32)
    vc = torch.randn_like(kc)
    before = (kc.clone(), vc.clone())
    calls = AttentionBackend("triton", KernelPolicy(decode_fuse_rotary="0")).warm_up(kc, vc, 4, 32 ** -0.5,
                                                                                     rotary_dim=32)
    big = max(18, pa.min_reqs_for_small_decode_tiles(DEVICE, 2))
    assert calls == 11 and len(launches) >= calls - 3 and decode_launches == [2, 17, big]   # 1-key contexts: no split-KV
    assert fused == []
    assert {pa.find_chunk(num_reqs) for num_reqs, _, _ in launches} == {16, 256}
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    if DEVICE.type == "cuda":   # 64-token prefill tiles split the decodes off into a launch of their own
        assert {rows for _, _, rows in launches} == {pa.ALL_ROWS, pa.DECODE_ROWS, pa.PREFILL_ROWS}
    assert AttentionBackend("torch").warm_up(kc, vc, 4, 0.1) == 0


def test_warm_up_also_runs_the_fused_decode_rotary(monkeypatch):
    """With the model's rotary_dim, the pure-decode warm-up batches that would take the fused
    rotary kernel (the backend's policy, ``decode_fuse_rotary``) run it too, writing nothing (slots -1)."""
    import kernels.paged_attention as pa
    from engine.attention import AttentionBackend
    from engine.kernel_policy import KernelPolicy

    fused = []
    rotary = pa.paged_decode_rotary
    monkeypatch.setattr(pa, "paged_decode_rotary", lambda *a, **kw: fused.append(a[0].shape[0]) or rotary(*a, **kw))
    kc = torch.randn(3, 16, 2, 32, device=DEVICE, dtype=torch.float16 if DEVICE.type == "cuda" else torch.float32)
    vc = torch.randn_like(kc)
    before = (kc.clone(), vc.clone())
    backend = AttentionBackend("triton", KernelPolicy(decode_fuse_rotary="1"))
    calls = backend.warm_up(kc, vc, 4, 32 ** -0.5, rotary_dim=32)
    big = max(18, pa.min_reqs_for_small_decode_tiles(DEVICE, 2))
    assert fused == [2, 17, big] and calls == 11 + len(fused)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_find_chunk_has_two_widths():
    assert [find_chunk(n) for n in (1, 16, 17, 256, 5000)] == [16, 16, 256, 256, 256]


# ----------------------------------------------------------------------------------------
# GPU: real sizes (Llama-3-8B attention shapes)
# ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("layout", ["decode_batch", "big_decode", "mixed_long"])
def test_gpu_real_sizes(layout, head_dim, dtype):
    """big_decode: enough programs for the one-warp decode tiles (``SMALL_DECODE_TILES``) on an H200."""
    rows = {"decode_batch": [(1, 100 + 37 * i) for i in range(24)],
            "big_decode": [(1, 1 + 17 * i) for i in range(128)],
            "mixed_long": [(1, 700), (300, 0), (1, 5), (129, 1000), (1, 2047)]}[layout]
    b = make_batch(rows, num_heads=32, num_kv_heads=8, head_dim=head_dim, dtype=dtype, seed=head_dim)
    scale = head_dim ** -0.5
    ref = paged_attention_ref(*b.args(), scale)
    assert_close(run_kernel(b, scale), ref, dtype)                   # auto split choice
    assert_close(run_kernel(b, scale, num_splits=8), ref, dtype)     # forced split-KV
    if layout == "decode_batch":                                     # kernels.paged_decode, 0 = general
        import kernels.paged_attention as pa

        for heads_per_prog in (0, 1, 4, 8):
            assert_close(run_kernel(b, scale, decode_tiles={"heads_per_prog": heads_per_prog}), ref, dtype)
        small = dict(zip(("tile_n", "num_warps", "num_stages"), pa.SMALL_DECODE_TILES))
        assert_close(run_kernel(b, scale, decode_tiles=small), ref, dtype)
