"""The CPU decode attention C kernel against its twin, and how its library is built and loaded."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from kernels import cpu_native
from kernels.cpu_decode_attention import CpuDecodeAttention, supports
from kernels.reference import paged_attention_ref


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cpu_kernels")


def kernel(build_dir, chunk_tokens: int) -> CpuDecodeAttention:
    k = CpuDecodeAttention.load(build_dir, chunk_tokens)
    assert k is not None, "the C kernel did not build (is gcc installed?)"
    return k


def make_decode(seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """Decode rows over shuffled blocks; every slot past a request's length holds NaN, so a kernel that
    weights one (even by 0) fails."""
    g = torch.Generator().manual_seed(seed)
    nblk = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(nblk) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    ids = torch.randperm(num_blocks, generator=g)
    width = max(nblk) + 2                                   # wider than needed, as the runner's tables are
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    start = 0
    for r, (s, n) in enumerate(zip(seq_lens, nblk)):
        block_tables[r, :n] = ids[start:start + n].to(torch.int32)
        start += n
        for pos in range(s):
            used[int(block_tables[r, pos // block_size]) * block_size + pos % block_size] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[~used] = float("nan")
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    return q, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),          # SmolLM2-135M
    (4, 4, 128, 16),         # MHA, head_dim 128
    (14, 2, 64, 32),         # Qwen2-0.5B's grouping, bigger blocks
    (6, 1, 80, 8),           # MQA, head_dim 80 (the generic copy), 8-slot blocks
])
@pytest.mark.parametrize("seq_lens,chunk_tokens", [
    ([1], 128),                          # one key
    ([5, 16, 17, 33], 128),              # partial, exact and just-over block ends
    ([300, 7, 129], 32),                 # several chunks per request, merged
    ([64] * 16, 128),                    # a full decode batch
])
def test_matches_ref(build_dir, num_heads, num_kv_heads, head_dim, block_size, seq_lens, chunk_tokens):
    q, kc, vc, bt, sl = make_decode(seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim ** -0.5
    out = kernel(build_dir, chunk_tokens)(q, kc, vc, bt, sl, max(seq_lens), scale, num_threads=2)
    ref = paged_attention_ref(q, kc, vc, torch.arange(len(seq_lens) + 1, dtype=torch.int32), sl, bt, scale)
    assert out.shape == q.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)       # float32 sums against float64


@pytest.mark.parametrize("window", [1, 5, 16, 40, 500])
@pytest.mark.parametrize("chunk_tokens,block_size", [(16, 16), (128, 8)])
def test_sliding_window(build_dir, window, chunk_tokens, block_size):
    """Only the last ``window`` keys: a window of one key, within a block, one block, across blocks and
    chunks, longer than every context. Blocks before a request's window hold NaN: never read."""
    seq_lens = [300, 7, 129, 16, 41]
    q, kc, vc, bt, sl = make_decode(seq_lens, 6, 2, 64, block_size, seed=window)
    ref = paged_attention_ref(q, kc, vc, torch.arange(len(seq_lens) + 1, dtype=torch.int32), sl, bt, 0.125,
                              window=window)
    for r, s in enumerate(seq_lens):
        for b in range(max(0, s - window) // block_size):
            kc[int(bt[r, b])] = float("nan")
            vc[int(bt[r, b])] = float("nan")
    out = kernel(build_dir, chunk_tokens)(q, kc, vc, bt, sl, max(seq_lens), 0.125, num_threads=2, window=window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_large_scores_and_threads(build_dir):
    """Scores of +-hundreds (a max far from the rest: the online softmax's rescaling and the zeroed tail
    weights), one thread and three: the same result."""
    q, kc, vc, bt, sl = make_decode([200, 45], 8, 2, 64, 16, seed=3)
    q = q * 30
    ref = paged_attention_ref(q, kc, vc, torch.arange(3, dtype=torch.int32), sl, bt, 0.125)
    for threads in (1, 3):
        out = kernel(build_dir, 48)(q, kc, vc, bt, sl, 200, 0.125, num_threads=threads)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_bfloat16_cache(build_dir, head_dim):
    """A bfloat16 cache is read as its float32 values (each specialized copy)."""
    q, kc, vc, bt, sl = make_decode([70, 16, 3], 8, 2, head_dim, 16, seed=5)
    kb, vb = kc.bfloat16(), vc.bfloat16()
    ref = paged_attention_ref(q, kb.float(), vb.float(), torch.arange(4, dtype=torch.int32), sl, bt, 0.1)
    out = kernel(build_dir, 32)(q, kb, vb, bt, sl, 70, 0.1)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_checks_arguments(build_dir):
    q, kc, vc, bt, sl = make_decode([20], 4, 2, 64, 16)
    k = kernel(build_dir, 128)
    with pytest.raises(ValueError, match="q: dtype"):
        k(q.half(), kc, vc, bt, sl, 20, 0.1)
    with pytest.raises(ValueError, match="block_tables"):
        k(q, kc, vc, bt[:, :1], sl, 20, 0.1)                 # 20 keys need 2 blocks
    with pytest.raises(ValueError, match="head_dim"):
        k(q[..., :60].contiguous(), kc[..., :60].contiguous(), vc[..., :60].contiguous(), bt, sl, 20, 0.1)
    assert supports(9, 3, 64, 16, torch.float32)
    assert supports(9, 3, 64, 16, torch.bfloat16) and not supports(9, 3, 64, 16, torch.float16)
    assert not supports(9, 4, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="v_cache: dtype"):
        k(q, kc, vc.bfloat16(), bt, sl, 20, 0.1)
    assert not supports(8, 2, 64, 12, torch.float32)


def test_library_is_built_once_per_host_and_cached(build_dir, tmp_path):
    lib = cpu_native.load("decode_attention", build_dir)
    assert lib is not None and cpu_native.load("decode_attention", build_dir) is lib
    built = list(build_dir.glob("decode_attention-*.so"))
    assert len(built) == 1 and built[0] == cpu_native.library_path("decode_attention", build_dir,
                                                                    cpu_native.shutil.which("cc"))
    # A fresh process's view: nothing loaded yet, the cached file is loaded without a compiler.
    cpu_native._loaded.clear()
    assert cpu_native._build_and_load("decode_attention", build_dir) is not None


def test_no_compiler_leaves_the_torch_path(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-compiler-chorus")
    with caplog.at_level(logging.WARNING, logger="chorus.kernels"):
        assert cpu_native._build_and_load("decode_attention", tmp_path) is None
    assert "No C compiler" in caplog.text and not list(tmp_path.iterdir())


def test_strided_query_rows(build_dir):
    """q as the runner has it: a view of a packed q | k | v projection output (rows strided)."""
    _, kc, vc, bt, sl = make_decode([40, 3], 4, 2, 64, 16)
    qkv = torch.randn(2, (4 + 2 * 2) * 64)
    q = qkv[:, :4 * 64].view(2, 4, 64)
    out = kernel(build_dir, 128)(q, kc, vc, bt, sl, 40, 0.125)
    ref = paged_attention_ref(q.contiguous(), kc, vc, torch.arange(3, dtype=torch.int32), sl, bt, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
