"""KV write: the Triton kernel against its twin, then write + attend end to end."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_write import write_kv
from kernels.paged_attention import paged_attention
from kernels.reference import paged_attention_ref, write_kv_ref


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""CPU tensors run the kernels through the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""


def make_step(num_tokens=9, num_kv_heads=2, head_dim=24, block_size=16, num_blocks=5, dtype=torch.float16,
              cache_dtype=None, pad=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(torch.int64)
    for i in pad:
        slots[i] = -1
    return tuple(t.to(DEVICE) for t in (k, v, k_cache, v_cache, slots))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("pad", [(), (0, 4, 8)])
def test_matches_ref(dtype, block_size, pad):
    k, v, kc, vc, slots = make_step(block_size=block_size, dtype=dtype, pad=pad)
    k_ref, v_ref = write_kv_ref(k, v, kc, vc, slots)
    write_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref)


def test_casts_to_cache_dtype_and_odd_heads():
    """fp32 rows into a bf16 cache. NOTE: the interpreter truncates fp32 -> bf16 where a GPU
    rounds to nearest, so allow one bf16 ulp."""
    k, v, kc, vc, slots = make_step(num_kv_heads=3, head_dim=20, dtype=torch.float32,
                                    cache_dtype=torch.bfloat16)
    k_ref, v_ref = write_kv_ref(k, v, kc, vc, slots)
    write_kv(k, v, kc, vc, slots)
    torch.testing.assert_close(kc.float(), k_ref.float(), rtol=2 ** -7, atol=0)
    torch.testing.assert_close(vc.float(), v_ref.float(), rtol=2 ** -7, atol=0)


def test_strided_views_of_fused_qkv():
    """k and v as views into one packed qkv output."""
    k, v, kc, vc, slots = make_step(dtype=torch.float32)
    qkv = torch.cat([torch.randn(9, 64, device=DEVICE), k.reshape(9, -1), v.reshape(9, -1)], dim=1)
    k_view = qkv[:, 64:112].view(9, 2, 24)
    v_view = qkv[:, 112:].view(9, 2, 24)
    assert not k_view.is_contiguous()
    k_ref, v_ref = write_kv_ref(k, v, kc, vc, slots)
    write_kv(k_view, v_view, kc, vc, slots)
    assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref)


def test_write_then_attend():
    """A prefill chunk with a cached prefix: write its K/V, then attend; matches the twin."""
    g = torch.Generator().manual_seed(3)
    block_size, kvh, d, ctx, qlen = 16, 2, 16, 20, 6
    k_cache = torch.randn(4, block_size, kvh, d, generator=g).to(DEVICE)   # prefix already cached
    v_cache = torch.randn(4, block_size, kvh, d, generator=g).to(DEVICE)
    block_table = torch.tensor([[2, 0]], dtype=torch.int32)
    pos = torch.arange(ctx, ctx + qlen)
    slots = (block_table[0].long()[pos // block_size] * block_size + pos % block_size).to(DEVICE)
    k_new = torch.randn(qlen, kvh, d, generator=g).to(DEVICE)
    v_new = torch.randn(qlen, kvh, d, generator=g).to(DEVICE)
    write_kv(k_new, v_new, k_cache, v_cache, slots)
    q = torch.randn(qlen, 4, d, generator=g).to(DEVICE)
    args = (q, k_cache, v_cache, torch.tensor([0, qlen], dtype=torch.int32, device=DEVICE),
            torch.tensor([ctx + qlen], dtype=torch.int32, device=DEVICE), block_table.to(DEVICE))
    out = paged_attention(*args, qlen, ctx + qlen, 0.25)
    torch.testing.assert_close(out, paged_attention_ref(*args, 0.25), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_cache[0, 4:10], k_new)              # positions 20..25 -> block 0


def test_rejects_bad_inputs():
    k, v, kc, vc, slots = make_step()
    with pytest.raises(ValueError, match="slot_mapping: dtype"):
        write_kv(k, v, kc, vc, slots.int())
    with pytest.raises(ValueError, match="slot_mapping: expected shape"):
        write_kv(k, v, kc, vc, slots[:-1])
    with pytest.raises(ValueError, match="v: expected shape"):
        write_kv(k, v[:, :1], kc, vc, slots)
    with pytest.raises(ValueError, match="k_cache: expected shape"):
        write_kv(k, v, kc[:, :, :1].contiguous(), vc, slots)
    with pytest.raises(ValueError, match="v_cache: dtype"):
        write_kv(k, v, kc, vc.float(), slots)
    with pytest.raises(ValueError, match="k_cache: must be contiguous"):
        write_kv(k, v, kc.transpose(0, 1), vc, slots)
    with pytest.raises(ValueError, match="k: last dim"):
        write_kv(k.transpose(1, 2).contiguous().transpose(1, 2), v, kc, vc, slots)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_real_sizes(dtype):
    k, v, kc, vc, slots = make_step(num_tokens=512, num_kv_heads=8, head_dim=128, num_blocks=64, dtype=dtype,
                                    pad=(3, 100, 511))
    k_ref, v_ref = write_kv_ref(k, v, kc, vc, slots)
    write_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref)


# ----------------------------------------------------------------------------------------
# rotary_write_kv: rotary on q/k in place fused with the cache write
# ----------------------------------------------------------------------------------------
def _rotary_tables(rotary_dim: int, max_pos: int = 300):
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]     # [max_pos, rotary_dim / 2]
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)                               # [max_pos, rotary_dim]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,rotary_dim",
                         [(4, 2, 16, 16), (6, 2, 24, 12), (4, 4, 80, 80), (8, 1, 32, 20)])
@pytest.mark.parametrize("pad", [(), (1, 5)])
def test_rotary_write_kv_matches_ref(dtype, num_heads, num_kv_heads, head_dim, rotary_dim, pad):
    """Views of a packed qkv (strided), partial rotary (pass-through tail), padding slots."""
    from kernels.kv_write import rotary_write_kv
    from kernels.reference import rotary_write_kv_ref

    k, v, kc, vc, slots = make_step(num_tokens=7, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                                    pad=pad, seed=num_heads + head_dim)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(7, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype).to(DEVICE)
    q, kk, vv = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q, kk, vv = (t.view(7, -1, head_dim) for t in (q, kk, vv))
    positions = torch.tensor([0, 3, 17, 31, 32, 200, 299], dtype=torch.int64, device=DEVICE)
    cos, sin = _rotary_tables(rotary_dim)
    half = rotary_dim // 2
    q_ref, k_ref, kc_ref, vc_ref = rotary_write_kv_ref(positions, q, kk, vv, cos, sin, rotary_dim, kc, vc, slots)
    rotary_write_kv(positions, q, kk, vv, cos[:, :half], sin[:, :half], rotary_dim, kc, vc, slots)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q.float(), q_ref.float(), **tol)
    torch.testing.assert_close(kk.float(), k_ref.float(), **tol)
    torch.testing.assert_close(kc.float(), kc_ref.float(), **tol)
    assert torch.equal(vc, vc_ref)
    # The cache holds exactly the (rotated) k the kernel left in place.
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(kc.view(-1, num_kv_heads, head_dim)[slot], kk[t].to(kc.dtype))


def test_rotary_write_kv_rejects_bad_inputs():
    from kernels.kv_write import rotary_write_kv

    k, v, kc, vc, slots = make_step(num_tokens=3, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    q = torch.zeros(3, 4, 16, device=DEVICE)
    pos = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    cos, sin = _rotary_tables(16)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_write_kv(pos, q, k, v, cos, sin, 15, kc, vc, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_write_kv(pos, q, k, v, cos[:, :8], sin[:, :8], 16, kc, vc, slots[:2])
    with pytest.raises(ValueError, match="v"):
        rotary_write_kv(pos, q, k, v[:, :1], cos[:, :8], sin[:, :8], 16, kc, vc, slots)
