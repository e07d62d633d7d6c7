"""``paged_decode_rotary``: a pure-decode step's rotary + KV write fused into the decode attention
kernel, against the unfused kernels (``rotary_write_kv`` then ``paged_attention``) and the torch
twins. CPU tensors run through the Triton interpreter (tests/conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.kv_write import rotary_write_kv
from kernels.paged_attention import paged_attention, paged_decode_rotary
from kernels.reference import paged_attention_ref, rotary_write_kv_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _tables(rotary_dim: int, max_pos: int = 256):
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)                # [max_pos, rotary_dim]


def _decode_step(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """A decode step: request i's token sits at position seq_lens[i] - 1 (its slot in the block
    table), its cached keys 0 .. seq_lens[i] - 2 are noise; q/k/v are views of one packed qkv."""
    g = torch.Generator().manual_seed(seed)
    blocks = [max(1, math.ceil(s / block_size)) for s in seq_lens]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    slots, used = [], 0
    for i, (n, s) in enumerate(zip(blocks, seq_lens)):
        block_tables[i, :n] = perm[used:used + n]
        used += n
        slots.append(int(block_tables[i, (s - 1) // block_size]) * block_size + (s - 1) % block_size)
    n = len(seq_lens)
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = (t.view(n, -1, head_dim) for t in
               qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1))
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    ints = dict(dtype=torch.int32, device=DEVICE)
    return dict(q=q.to(DEVICE), k=k.to(DEVICE), v=v.to(DEVICE), k_cache=k_cache.to(DEVICE),
                v_cache=v_cache.to(DEVICE), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
                positions=torch.tensor([s - 1 for s in seq_lens], dtype=torch.int64, device=DEVICE),
                query_start_loc=torch.arange(n + 1, **ints), seq_lens=torch.tensor(seq_lens, **ints),
                block_tables=block_tables.to(DEVICE), max_seq_len=max(seq_lens))


def _fused(b, cos, sin, rotary_dim, scale, **kw):
    half = rotary_dim // 2
    return paged_decode_rotary(b["q"], b["k"], b["v"], b["positions"], cos[:, :half], sin[:, :half], rotary_dim,
                               b["k_cache"], b["v_cache"], b["slot_mapping"], b["query_start_loc"], b["seq_lens"],
                               b["block_tables"], b["max_seq_len"], scale, **kw)


def _unfused(b, cos, sin, rotary_dim, scale, **kw):
    half = rotary_dim // 2
    q = b["q"].clone()
    rotary_write_kv(b["positions"], q, b["k"].clone(), b["v"], cos[:, :half], sin[:, :half], rotary_dim,
                    b["k_cache"], b["v_cache"], b["slot_mapping"])
    return paged_attention(q, b["k_cache"], b["v_cache"], b["query_start_loc"], b["seq_lens"], b["block_tables"],
                           1, b["max_seq_len"], scale, **kw)


def _assert_same_cache(a: dict, b: dict, dtype: torch.dtype) -> None:
    """Caches after the fused and the unfused step: V bit-equal; K bit-equal under the interpreter
    (both rotations computed in the same order), within rounding on CUDA (the compiler may contract
    the two rotations' multiply-adds differently)."""
    assert torch.equal(a["v_cache"], b["v_cache"])
    if DEVICE.type == "cpu":
        assert torch.equal(a["k_cache"], b["k_cache"])
    else:
        torch.testing.assert_close(a["k_cache"].float(), b["k_cache"].float(), atol=TOL[dtype], rtol=TOL[dtype])


SEQ_LENS = [1, 2, 17, 32, 33, 64, 95]
"""Contexts after the step: a first token (no cached key), at and across block and tile edges."""


HEAD_SHAPES = [(4, 2, 32, 32), (8, 2, 64, 32), (6, 2, 24, 12), (4, 4, 80, 80), (8, 1, 128, 128),
               (2, 1, 256, 64)]
"""(num_heads, num_kv_heads, head_dim, rotary_dim)."""
CASES = [(dtype, *shape, num_splits) for i, shape in enumerate(HEAD_SHAPES)
         for dtype, num_splits in [((torch.float32, torch.bfloat16)[i % 2], (1, 4)[i // 2 % 2])]]
"""Every head shape once; dtype and split count in turn (each of their four pairs at least once)."""


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,rotary_dim,num_splits", CASES)
def test_matches_unfused_kernels_and_twin(dtype, num_heads, num_kv_heads, head_dim, rotary_dim, num_splits):
    """Same output as rotary_write_kv + paged_attention, the same cache afterwards (the rotated k and
    v at each token's slot, nothing else touched), and the torch twins' output; GQA / MQA / MHA,
    partial rotary, head dims padded to a power of two (24-256), split-KV with its merge."""
    b = _decode_step(SEQ_LENS, num_heads, num_kv_heads, head_dim, 16, dtype, seed=head_dim + num_splits)
    cos, sin = _tables(rotary_dim)
    scale = head_dim ** -0.5
    caches = (b["k_cache"].clone(), b["v_cache"].clone())
    q_before, k_before = b["q"].clone(), b["k"].clone()
    out = _fused(b, cos, sin, rotary_dim, scale, num_splits=num_splits)
    assert torch.equal(b["q"], q_before) and torch.equal(b["k"], k_before)        # inputs not written
    fused_caches = (b["k_cache"].clone(), b["v_cache"].clone())
    b["k_cache"].copy_(caches[0])
    b["v_cache"].copy_(caches[1])
    ref = _unfused(b, cos, sin, rotary_dim, scale, num_splits=num_splits)
    _assert_same_cache(dict(k_cache=fused_caches[0], v_cache=fused_caches[1]), b, dtype)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    q_rot, _, kc_ref, vc_ref = rotary_write_kv_ref(b["positions"], q_before, k_before, b["v"], cos, sin, rotary_dim,
                                                   caches[0], caches[1], b["slot_mapping"])
    twin = paged_attention_ref(q_rot, kc_ref, vc_ref, b["query_start_loc"], b["seq_lens"], b["block_tables"], scale)
    torch.testing.assert_close(out.float(), twin.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("block_size", [32, 64])
def test_block_sizes(block_size):
    b = _decode_step([1, 31, 32, 33, 100], 4, 1, 16, block_size, torch.float32, seed=block_size)
    cos, sin = _tables(16)
    ref_b = {key: (t.clone() if isinstance(t, torch.Tensor) else t) for key, t in b.items()}
    out = _fused(b, cos, sin, 16, 0.25)
    ref = _unfused(ref_b, cos, sin, 16, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    _assert_same_cache(b, ref_b, torch.float32)


def test_padding_rows_write_nothing():
    """Rows of a padded CUDA-graph batch (slot -1) leave the cache as it was; seq_len 0 gives zeros."""
    b = _decode_step([5, 9, 3], 4, 2, 16, 16, torch.float32, seed=3)
    b["slot_mapping"][1] = -1
    b["seq_lens"][2] = 0
    before = (b["k_cache"].clone(), b["v_cache"].clone())
    cos, sin = _tables(16)
    out = _fused(b, cos, sin, 16, 0.25)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    slot0 = int(b["slot_mapping"][0])
    changed = (b["k_cache"] != before[0]).view(-1, 2 * 16).any(-1).nonzero().flatten().tolist()
    assert changed == [slot0]                  # only request 0 wrote; request 1's slot is -1
    assert torch.isfinite(out).all()


def test_rejects_a_batch_that_is_not_pure_decode():
    b = _decode_step([5, 9], 4, 2, 16, 16, torch.float32, seed=4)
    cos, sin = _tables(16)
    with pytest.raises(ValueError, match="pure-decode"):
        paged_decode_rotary(b["q"][:1], b["k"][:1], b["v"][:1], b["positions"][:1], cos[:, :8], sin[:, :8], 16,
                            b["k_cache"], b["v_cache"], b["slot_mapping"][:1], b["query_start_loc"], b["seq_lens"],
                            b["block_tables"], b["max_seq_len"], 0.25)
