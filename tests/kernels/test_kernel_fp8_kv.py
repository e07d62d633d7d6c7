"""FP8 (e4m3) KV cache: every kernel that writes K/V stores e4m3(clamp(x / scale, -448, 448)), bit-equal to
the torch twin ``fp8_quantize_ref``; every attention kernel attends over the stored values times the scales,
checked against ``paged_attention_ref`` on the dequantized cache. Scales differ from 1 throughout. CPU
tensors run through the Triton interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from kernels.kv_write import FP8_E4M3_MAX, FP8_KV_DTYPE, fp8_quantize_ref, rotary_write_kv, write_kv
from kernels.paged_attention import paged_attention, paged_decode_rotary
from kernels.reference import paged_attention_ref, rotary_write_kv_ref, write_kv_ref
from tests.kernels.test_kernel_kv_write import DEVICE, _rotary_tables, make_step
from tests.kernels.test_kernel_lora_rotary import run_case
from tests.kernels.test_kernel_paged_attention import LAYOUTS, TOL, AttnBatch, make_batch
from tests.kernels.test_kernel_paged_decode_rotary import _decode_step

K_SCALE, V_SCALE = 0.37, 2.5
"""Scales of the caches below: K / 0.37 and V / 2.5 are stored (neither a power of two)."""


def dequantized(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 cache means: its values times the scale, float32 (exact)."""
    return cache.float() * scale


def fp8_batch(layout, dtype, seed=0, **kw) -> AttnBatch:
    """``make_batch``'s step with FP8 caches holding random K and V (std 1) quantized by the scales."""
    b = make_batch(layout, dtype=dtype, seed=seed, **kw)
    return AttnBatch(b.q, fp8_quantize_ref(b.k_cache, K_SCALE), fp8_quantize_ref(b.v_cache, V_SCALE),
                     b.query_start_loc, b.seq_lens, b.block_tables, b.max_query_len, b.max_seq_len)


def reference(b: AttnBatch, scale: float) -> torch.Tensor:
    """The twin on the dequantized caches."""
    return paged_attention_ref(b.q, dequantized(b.k_cache, K_SCALE), dequantized(b.v_cache, V_SCALE),
                               b.query_start_loc, b.seq_lens, b.block_tables, scale)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """FP8 tensors equal bit for bit (-0.0 and NaN patterns included)."""
    a, e = actual.view(torch.uint8), expected.view(torch.uint8)
    bad = (a != e).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} bytes differ, first at {bad[0].tolist()}: {a[tuple(bad[0])]} vs " \
                             f"{e[tuple(bad[0])]}"


# ----------------------------------------------------------------------------------------
# Quantize on write
# ----------------------------------------------------------------------------------------
def _every_e4m3_value_and_tie() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (round-half-to-even cases), values past the
    saturation bound, signed zeros and float32 values below the smallest subnormal."""
    finite = torch.arange(256, dtype=torch.uint8).view(FP8_KV_DTYPE).float()
    finite = finite[~finite.isnan()].unique()                                   # sorted, -448 .. 448
    mids = (finite[1:] + finite[:-1]) / 2
    extra = torch.tensor([-0.0, 0.0, 449.0, 464.0, 500.0, -1e6, 3e38, 2.0 ** -11, -(2.0 ** -10), 1e-30])
    return torch.cat([finite, mids, extra])


@pytest.mark.parametrize("scale", [1.0, 2.0, 0.37])
def test_write_rounds_like_torch_on_every_value(scale):
    """``write_kv`` into an FP8 cache: each value x (here value * scale) is stored as torch's
    e4m3(clamp(x / scale, -448, 448)): ties to even, subnormals, saturation, -0.0."""
    values = _every_e4m3_value_and_tie() * scale
    head_dim = 16
    n = -(-values.numel() // head_dim)
    k = torch.zeros(n * head_dim).index_copy_(0, torch.arange(values.numel()), values).view(n, 1, head_dim)
    v = -k
    k_cache = torch.zeros(n, 1, 1, head_dim, dtype=FP8_KV_DTYPE)                 # one token per block
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(n, dtype=torch.int64)
    k, v, k_cache, v_cache, slots = (t.to(DEVICE) for t in (k, v, k_cache, v_cache, slots))
    write_kv(k, v, k_cache, v_cache, slots, k_scale=scale, v_scale=scale)
    assert_bits_equal(k_cache.view(n, 1, head_dim), fp8_quantize_ref(k, scale))
    assert_bits_equal(v_cache.view(n, 1, head_dim), fp8_quantize_ref(v, scale))
    assert k_cache.float().abs().max() == FP8_E4M3_MAX                          # saturated, not NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pad", [(), (0, 4, 8)])
def test_write_kv_matches_ref(dtype, pad):
    k, v, kc, vc, slots = make_step(dtype=dtype, cache_dtype=FP8_KV_DTYPE, pad=pad)
    k, v = k * 3, v * 300                                                        # v / 2.5 saturates in places
    k_ref, v_ref = write_kv_ref(fp8_quantize_ref(k, K_SCALE), fp8_quantize_ref(v, V_SCALE), kc, vc, slots)
    write_kv(k, v, kc, vc, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    assert_bits_equal(kc, k_ref)
    assert_bits_equal(vc, v_ref)


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,rotary_dim",
                         [(torch.float32, 4, 2, 16, 16), (torch.bfloat16, 6, 2, 24, 12)])
def test_rotary_write_kv_matches_ref(dtype, num_heads, num_kv_heads, head_dim, rotary_dim):
    """q and k rotated in place as for a float cache; the cache holds the rotated k (in k's dtype) and v,
    quantized (full and partial rotary, a padding slot)."""
    k, v, kc, vc, slots = make_step(num_tokens=7, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                                    cache_dtype=FP8_KV_DTYPE, pad=(2,), seed=head_dim)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(7, num_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    positions = torch.tensor([0, 3, 17, 31, 32, 200, 299], dtype=torch.int64, device=DEVICE)
    cos, sin = _rotary_tables(rotary_dim)
    half = rotary_dim // 2
    q_ref, k_ref, _, _ = rotary_write_kv_ref(positions, q, k, v, cos, sin, rotary_dim, kc.float(), vc.float(),
                                             slots)
    kc_before = kc.clone()
    rotary_write_kv(positions, q, k, v, cos[:, :half], sin[:, :half], rotary_dim, kc, vc, slots,
                    k_scale=K_SCALE, v_scale=V_SCALE)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q.float(), q_ref.float(), **tol)
    torch.testing.assert_close(k.float(), k_ref.float(), **tol)
    kc_ref, vc_ref = write_kv_ref(fp8_quantize_ref(k, K_SCALE), fp8_quantize_ref(v, V_SCALE), kc_before,
                                  vc.clone(), slots)
    assert_bits_equal(kc, kc_ref)                  # exactly the rotated k the kernel left in place, quantized
    assert_bits_equal(vc, vc_ref)


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (6, 2, 24, 12)), (torch.bfloat16, (4, 2, 16, 16))],
                         ids=["f32-partial", "bf16-gqa"])
def test_lora_rotary_write_kv_matches_ref(dtype, shape):
    """The LoRA-fused rotary + write: q/k/v as the twin's; the cache holds the updated, rotated k and the
    updated v the kernel left in place, quantized; padding slots write nothing."""
    num_heads, num_kv_heads, head_dim, _ = shape
    _, _, kc0, vc0, _ = make_step(num_tokens=7, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                                  cache_dtype=FP8_KV_DTYPE, pad=(1, 5), seed=num_heads + head_dim, num_blocks=64)
    got, want, slots, _ = run_case(dtype, *shape, (1, 5), False, cache_dtype=FP8_KV_DTYPE,
                                   kv_scales=(K_SCALE, V_SCALE))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for name, a, b in zip(("q", "k", "v"), got[:3], want[:3]):
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m: f"{name}: {m}")
    _, kk, vv, kc, vc = got
    kc_ref, vc_ref = write_kv_ref(fp8_quantize_ref(kk, K_SCALE), fp8_quantize_ref(vv, V_SCALE), kc0, vc0, slots)
    assert_bits_equal(kc, kc_ref)
    assert_bits_equal(vc, vc_ref)


# ----------------------------------------------------------------------------------------
# Attention over an FP8 cache
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,dtype", [
    ("decodes", torch.float32), ("decodes", torch.float16), ("decodes", torch.bfloat16),
    ("prefills", torch.float16), ("mixed", torch.bfloat16), ("mixed_decodes_last", torch.float32)])
def test_attention_matches_ref_on_dequantized_cache(layout, dtype):
    """Mixed batches (prefill chunks with and without a prefix, decodes; pure decode takes
    ``kernels.paged_decode``): attention over k_cache * k_scale, v_cache * v_scale. Every dtype on the
    pure-decode kernel and on the general kernel, every layout."""
    b = fp8_batch(LAYOUTS[layout], dtype)
    scale = 32 ** -0.5
    out = paged_attention(*b.args(), b.max_query_len, b.max_seq_len, scale, k_scale=K_SCALE, v_scale=V_SCALE)
    assert out.dtype == dtype
    assert_close(out, reference(b, scale), dtype)


@pytest.mark.parametrize("kw", [dict(num_splits=4), dict(split_decodes=True),
                                dict(decode_tiles={"heads_per_prog": 2}), dict(num_splits=2)],
                         ids=["split-kv", "split-decodes", "heads-per-prog-2", "decode-split-kv"])
def test_attention_launch_variants(kw):
    """Split-KV (the scale applied before the merge), separate decode and prefill launches, and the
    pure-decode kernel with two KV heads per program."""
    layout = LAYOUTS["decodes"] if kw.get("num_splits") == 2 or "decode_tiles" in kw else LAYOUTS["mixed"]
    b = fp8_batch(layout, torch.float16, seed=5)
    out = paged_attention(*b.args(), b.max_query_len, b.max_seq_len, 0.2, k_scale=K_SCALE, v_scale=V_SCALE, **kw)
    assert_close(out, reference(b, 0.2), torch.float16)


def test_scales_are_applied():
    """The same stored bytes read with other scales give another result (the twin's, for those scales)."""
    b = fp8_batch(LAYOUTS["mixed"], torch.float32, seed=2)
    args = (*b.args(), b.max_query_len, b.max_seq_len, 0.25)
    unit = paged_attention(*args)
    scaled = paged_attention(*args, k_scale=K_SCALE, v_scale=V_SCALE)
    assert not torch.allclose(unit, scaled, atol=1e-2)
    assert_close(unit, paged_attention_ref(b.q, b.k_cache.float(), b.v_cache.float(), *b.args()[3:], 0.25),
                 torch.float32)


@pytest.mark.parametrize("dtype,num_splits", [(torch.float32, 2), (torch.bfloat16, 1)])
def test_decode_rotary_matches_ref(dtype, num_splits):
    """The fused rotary + KV write + decode attention: the new k and v are quantized into the cache as
    ``rotary_write_kv`` quantizes them, and attended as stored (times the scales)."""
    seq_lens, rotary_dim = [5, 33, 17], 16
    b = _decode_step(seq_lens, 4, 2, 16, 16, dtype, seed=3)
    b["k_cache"], b["v_cache"] = fp8_quantize_ref(b["k_cache"], K_SCALE), fp8_quantize_ref(b["v_cache"], V_SCALE)
    cos, sin = _rotary_tables(rotary_dim)
    half = rotary_dim // 2
    q_ref, k_ref, _, _ = rotary_write_kv_ref(b["positions"], b["q"], b["k"], b["v"], cos, sin, rotary_dim,
                                             b["k_cache"].float(), b["v_cache"].float(), b["slot_mapping"])
    kc_ref, vc_ref = write_kv_ref(fp8_quantize_ref(k_ref, K_SCALE), fp8_quantize_ref(b["v"], V_SCALE),
                                  b["k_cache"], b["v_cache"], b["slot_mapping"])
    unfused = {name: b[name].clone() for name in ("k_cache", "v_cache")}
    q_unfused = b["q"].clone()
    rotary_write_kv(b["positions"], q_unfused, b["k"].clone(), b["v"], cos[:, :half], sin[:, :half], rotary_dim,
                    unfused["k_cache"], unfused["v_cache"], b["slot_mapping"], k_scale=K_SCALE, v_scale=V_SCALE)
    out = paged_decode_rotary(b["q"], b["k"], b["v"], b["positions"], cos[:, :half], sin[:, :half], rotary_dim,
                              b["k_cache"], b["v_cache"], b["slot_mapping"], b["query_start_loc"], b["seq_lens"],
                              b["block_tables"], b["max_seq_len"], 0.25, num_splits=num_splits,
                              k_scale=K_SCALE, v_scale=V_SCALE)
    assert_bits_equal(b["v_cache"], vc_ref)
    assert_bits_equal(b["v_cache"], unfused["v_cache"])
    if DEVICE.type == "cpu":                        # on CUDA the two rotations may round differently
        assert_bits_equal(b["k_cache"], unfused["k_cache"])
    # The twin's rotation may round k one ulp of its dtype away, hence one e4m3 step.
    torch.testing.assert_close(b["k_cache"].float(), kc_ref.float(), rtol=2 ** -3, atol=2 ** -9)
    want = paged_attention_ref(q_ref.to(dtype), dequantized(b["k_cache"], K_SCALE),
                               dequantized(b["v_cache"], V_SCALE), b["query_start_loc"], b["seq_lens"],
                               b["block_tables"], 0.25)
    assert_close(out, want, dtype)


def test_backend_writes_and_attends_with_the_layers_scales():
    """``AttentionBackend('triton')``: write_kv then attend with a layer's scales, as ``PagedAttention``
    calls them, against the twin on the dequantized cache."""
    g = torch.Generator().manual_seed(4)
    block_size, kvh, d, ctx, qlen = 16, 2, 16, 20, 6
    k_cache = fp8_quantize_ref(torch.randn(4, block_size, kvh, d, generator=g), K_SCALE).to(DEVICE)
    v_cache = fp8_quantize_ref(torch.randn(4, block_size, kvh, d, generator=g), V_SCALE).to(DEVICE)
    block_table = torch.tensor([[2, 0]], dtype=torch.int32, device=DEVICE)
    pos = torch.arange(ctx, ctx + qlen)
    slots = (block_table[0].long().cpu()[pos // block_size] * block_size + pos % block_size).to(DEVICE)
    k_new = torch.randn(qlen, kvh, d, generator=g).to(torch.bfloat16).to(DEVICE)
    v_new = torch.randn(qlen, kvh, d, generator=g).to(torch.bfloat16).to(DEVICE)
    q = torch.randn(qlen, 4, d, generator=g).to(torch.bfloat16).to(DEVICE)
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.tensor([0, qlen], dtype=torch.int32,
                                                                              device=DEVICE),
                             seq_lens=torch.tensor([ctx + qlen], dtype=torch.int32, device=DEVICE),
                             block_tables=block_table, max_query_len=qlen, max_seq_len=ctx + qlen)
    backend = AttentionBackend("triton")
    backend.write_kv(k_new, v_new, k_cache, v_cache, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    out = backend.attend(q, k_cache, v_cache, meta, 0.25, k_new, v_new, k_scale=K_SCALE, v_scale=V_SCALE)
    assert_bits_equal(k_cache[0, 4:10], fp8_quantize_ref(k_new, K_SCALE))         # positions 20..25 -> block 0
    want = paged_attention_ref(q, dequantized(k_cache, K_SCALE), dequantized(v_cache, V_SCALE),
                               meta.query_start_loc, meta.seq_lens, block_table, 0.25)
    assert_close(out, want, torch.bfloat16)
    # The dequantized new keys are within e4m3's rounding (3 mantissa bits: 1/16 relative) of the written ones.
    torch.testing.assert_close(dequantized(k_cache[0, 4:10], K_SCALE), k_new.float(), rtol=2 ** -4, atol=2 ** -9)


def test_warm_up_needs_the_model_dtype_with_fp8():
    cache = torch.zeros(2, 16, 2, 16, dtype=FP8_KV_DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="q_dtype is required"):
        AttentionBackend("triton").warm_up(cache, cache, 4, 0.25)


def test_rejects_bad_scales():
    b = fp8_batch(LAYOUTS["decodes"], torch.float32)
    args = (*b.args(), b.max_query_len, b.max_seq_len, 0.25)
    with pytest.raises(ValueError, match="v_scale: expected a positive"):
        paged_attention(*args, v_scale=0.0)
    with pytest.raises(ValueError, match="k_scale: expected a positive"):
        paged_attention(*args, k_scale=torch.tensor(0.5))
    with pytest.raises(ValueError, match="v_cache: dtype"):
        paged_attention(b.q, b.k_cache, b.v_cache.float(), *b.args()[3:], b.max_query_len, b.max_seq_len, 0.25)
    float_b = make_batch(LAYOUTS["decodes"])
    with pytest.raises(ValueError, match="FP8 KV cache only"):
        paged_attention(*float_b.args(), float_b.max_query_len, float_b.max_seq_len, 0.25, k_scale=0.5)
    k, v, kc, vc, slots = make_step()
    with pytest.raises(ValueError, match="FP8 KV cache only"):
        write_kv(k, v, kc, vc, slots, v_scale=2.0)
    with pytest.raises(ValueError, match="k_cache: dtype"):                     # float caches take q's dtype
        paged_attention(b.q.half(), b.k_cache.float(), b.v_cache.float(), *b.args()[3:], b.max_query_len,
                        b.max_seq_len, 0.25)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", [[(1, 700)] * 3, [(1, 534)] * 64, [(300, 0), (1, 900), (77, 130)]],
                         ids=["small-decode", "decode-batch", "mixed"])
def test_gpu_llama3_sizes(layout):
    """Llama-3-8B heads (32 / 8 x 128), bf16 queries, 16-token blocks, on the GPU's tiles and split-KV."""
    b = fp8_batch(layout, torch.bfloat16, num_heads=32, num_kv_heads=8, head_dim=128, seed=7)
    out = paged_attention(*b.args(), b.max_query_len, b.max_seq_len, 128 ** -0.5, k_scale=K_SCALE,
                          v_scale=V_SCALE)
    assert_close(out, reference(b, 128 ** -0.5), torch.bfloat16)
