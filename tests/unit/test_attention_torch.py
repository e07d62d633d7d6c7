"""The CPU attention backend's fast paths (batched fresh prefills, batched decodes, the KV write) and the CPU
RMSNorm against their twins."""

import pytest
import torch

from engine.attention import paged_attention_torch
from kernels.reference import paged_attention_ref
from tests.kernels.test_kernel_paged_attention import assert_close, engine_meta, make_batch


def _new_kv(b, layout):
    """This step's K/V rows (already in the cache, as the runner writes them before attending)."""
    bs = b.k_cache.shape[1]
    ks, vs = [], []
    for i, (qlen, ctx) in enumerate(layout):
        pos = torch.arange(ctx, ctx + qlen)
        slots = b.block_tables[i, pos // bs].long() * bs + pos % bs
        ks.append(b.k_cache.flatten(0, 1)[slots])
        vs.append(b.v_cache.flatten(0, 1)[slots])
    return torch.cat(ks), torch.cat(vs)


@pytest.mark.parametrize("layout", [
    [(1, 30), (1, 9), (7, 0), (7, 0), (7, 0), (5, 0), (4, 12)],   # decodes, 3 equal fresh prefills, odd ones
    [(16, 0), (16, 0)],
    [(9, 0), (3, 5), (9, 0)],                                       # equal fresh prefills, not adjacent
    [(1, 30), (1, 9), (1, 1)],                                      # a pure decode step (returns its rows)
])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 6])
@pytest.mark.parametrize("decode_kernel", [False, True])
def test_fast_paths_match_ref(layout, num_kv_heads, decode_kernel, tmp_path_factory):
    """Every path, with the decode rows through SDPA over a gathered copy or through the CPU C kernel."""
    b = make_batch(layout, num_heads=6, num_kv_heads=num_kv_heads)
    k_new, v_new = _new_kv(b, layout)
    scale = 32 ** -0.5
    kernel = _cpu_decode_kernel(tmp_path_factory) if decode_kernel else None
    out = paged_attention_torch(b.q, b.k_cache, b.v_cache, engine_meta(b, layout), scale, k_new, v_new,
                                decode_kernel=kernel)
    assert_close(out, paged_attention_ref(*b.args(), scale), torch.float32)


def _cpu_decode_kernel(tmp_path_factory):
    from kernels.cpu_decode_attention import CpuDecodeAttention
    kernel = CpuDecodeAttention.load(tmp_path_factory.getbasetemp() / "cpu_kernels", chunk_tokens=16)
    assert kernel is not None, "the CPU decode kernel did not build (is gcc installed?)"
    return kernel


def test_cpu_backend_takes_the_decode_kernel_per_policy(tmp_path):
    """``select_backend`` builds the C kernel on CPU where the policy asks; the backend passes it only for
    caches it supports (float32 and bfloat16; a float16 cache keeps SDPA)."""
    from engine.attention import select_backend
    from engine.kernel_policy import KernelPolicy
    on = select_backend(torch.device("cpu"), KernelPolicy(), cpu_kernel_dir=tmp_path)
    off = select_backend(torch.device("cpu"), KernelPolicy(cpu_decode_attention=False), cpu_kernel_dir=tmp_path)
    assert on.cpu_decode is not None and on.cpu_decode.chunk_tokens == KernelPolicy().cpu_decode_chunk_tokens
    assert off.cpu_decode is None
    b = make_batch([(1, 40), (1, 7)], num_heads=6, num_kv_heads=2)
    calls = []
    real = on.cpu_decode

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)
    on.cpu_decode = counted
    meta = engine_meta(b, [(1, 40), (1, 7)])
    out = on.attend(b.q, b.k_cache, b.v_cache, meta, 0.125)
    assert calls == [torch.Size([2, 6, 32])]
    assert_close(out, paged_attention_ref(*b.args(), 0.125), torch.float32)
    bf = on.attend(b.q, b.k_cache.bfloat16(), b.v_cache.bfloat16(), meta, 0.125)      # the kernel reads bf16
    assert len(calls) == 2
    assert_close(bf, paged_attention_ref(b.q, b.k_cache.bfloat16().float(), b.v_cache.bfloat16().float(),
                                         *b.args()[3:], 0.125), torch.float32)
    half = on.attend(b.q, b.k_cache.half(), b.v_cache.half(), meta, 0.125)            # not float16: SDPA
    assert len(calls) == 2 and half.shape == out.shape


@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize("context", [1, 16, 37])
def test_lone_decode_reads_consecutive_blocks_in_place(consecutive, context):
    """A lone decode row whose blocks are consecutive ids is read as a view of the cache (no gather);
    scattered ids take the gather. Both equal the reference; the plan is built once per step."""
    b = make_batch([(1, context)], num_heads=6, num_kv_heads=2)
    n = b.block_tables.shape[1]
    first = 1
    b.block_tables[0, :n] = (torch.arange(first, first + n) if consecutive
                             else torch.arange(first + n - 1, first - 1, -1)).to(torch.int32)
    meta = engine_meta(b, [(1, context)])
    scale = 32 ** -0.5
    out = paged_attention_torch(b.q, b.k_cache, b.v_cache, meta, scale)
    assert_close(out, paged_attention_ref(*b.args(), scale), torch.float32)
    multi_block = n > 1
    assert meta.torch_decode.first_block == (first if consecutive or not multi_block else None)
    again = paged_attention_torch(b.q, b.k_cache, b.v_cache, meta, scale)      # the second layer: same plan
    torch.testing.assert_close(again, out)


@pytest.mark.parametrize("slots", ["consecutive", "two runs", "shuffled", "padded"])
def test_write_kv_torch_stores_each_row_at_its_slot(slots):
    """The slice write of consecutive slots (``SLICE_WRITE_MIN_TOKENS`` rows and more) and the indexed write
    store the same rows; slot -1 writes nothing."""
    from engine.attention import SLICE_WRITE_MIN_TOKENS, write_kv_torch
    n, num_blocks, block_size = SLICE_WRITE_MIN_TOKENS + 9, 12, 16
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(n, 2, 8, generator=gen), torch.randn(n, 2, 8, generator=gen)
    if slots == "consecutive":
        slot_mapping = torch.arange(20, 20 + n)
    elif slots == "two runs":
        slot_mapping = torch.cat([torch.arange(100, 100 + n // 2), torch.arange(10, 10 + n - n // 2)])
    elif slots == "shuffled":
        slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    else:
        slot_mapping = torch.arange(20, 20 + n)
        slot_mapping[-3:] = -1
    k_cache, v_cache = torch.zeros(num_blocks, block_size, 2, 8), torch.zeros(num_blocks, block_size, 2, 8)
    # The runner's host flag: False (no -1 slots) skips the per-layer check, None checks.
    write_kv_torch(k, v, k_cache, v_cache, slot_mapping, slots_padded=None if slots == "padded" else False)
    keep = slot_mapping >= 0
    expect_k, expect_v = torch.zeros(num_blocks * block_size, 2, 8), torch.zeros(num_blocks * block_size, 2, 8)
    expect_k[slot_mapping[keep]], expect_v[slot_mapping[keep]] = k[keep], v[keep]
    assert torch.equal(k_cache.view(-1, 2, 8), expect_k) and torch.equal(v_cache.view(-1, 2, 8), expect_v)


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_rms_norm_equals_its_reference(rows, with_residual, dtype):
    """The CPU RMSNorm (``torch.rms_norm`` for float32 rows) gives the reference's values bit for bit."""
    from engine.layers.norm import RMSNorm
    from kernels.reference import rms_norm_ref
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(96, 1e-6).to(dtype)
    norm.weight.data = torch.randn(96, generator=gen).to(dtype)
    x = (torch.randn(rows, 96, generator=gen) * 4).to(dtype)
    residual = torch.randn(rows, 96, generator=gen).to(dtype) if with_residual else None
    out, ref = norm.forward_torch(x, residual), rms_norm_ref(x, norm.weight, 1e-6, residual)
    for a, b in zip(out if with_residual else [out], ref if with_residual else [ref]):
        assert a.dtype == dtype and torch.equal(a, b)


@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("num_kv_heads", [1, 3])
def test_chunk_over_a_cached_prefix_splits_into_two_merged_calls(with_lse, num_kv_heads, monkeypatch):
    """A prefill chunk after a cached prefix: two flash calls (prefix, then the chunk causally) merged by their
    log-sum-exps, or the one masked call where torch lacks the flash op: both equal the reference."""
    import engine.attention as attention
    if not with_lse:
        monkeypatch.setattr(attention, "_FLASH_WITH_LSE", None)
    layout = [(1, 30), (40, 70), (17, 1)]
    b = make_batch(layout, num_heads=6, num_kv_heads=num_kv_heads)
    k_new, v_new = _new_kv(b, layout)
    scale = 32 ** -0.5
    out = paged_attention_torch(b.q, b.k_cache, b.v_cache, engine_meta(b, layout), scale, k_new, v_new)
    assert_close(out, paged_attention_ref(*b.args(), scale), torch.float32)


@pytest.mark.parametrize("num_kv_heads", [1, 3])
def test_long_chunks_attend_in_bf16_only_where_asked(num_kv_heads):
    """With ``bf16_min_tokens``, prefill chunks of at least that many queries (after a cached prefix, fresh,
    and fresh ones batched together) attend with bfloat16 q/k/v: within bf16's tolerance of the reference,
    and each unlike float32's result; shorter chunks and decodes stay float32, equal to the call without it."""
    layout = [(1, 30), (40, 70), (33, 0), (12, 5), (33, 0)]                     # the 33s: one batched call
    b = make_batch(layout, num_heads=6, num_kv_heads=num_kv_heads)
    k_new, v_new = _new_kv(b, layout)
    scale = 32 ** -0.5
    exact = paged_attention_torch(b.q, b.k_cache, b.v_cache, engine_meta(b, layout), scale, k_new, v_new)
    low = paged_attention_torch(b.q, b.k_cache, b.v_cache, engine_meta(b, layout), scale, k_new, v_new,
                                bf16_min_tokens=33)
    ref = paged_attention_ref(*b.args(), scale)
    assert low.dtype == torch.float32
    assert_close(low, ref, torch.bfloat16)
    for start, end in ((1, 41), (41, 74), (86, 119)):                             # the 40- and 33-query chunks
        assert not torch.equal(low[start:end], exact[start:end])
    short_rows = torch.tensor([0] + list(range(74, 86)))                          # the decode, the 12-query chunk
    torch.testing.assert_close(low[short_rows], exact[short_rows], atol=0, rtol=0)


def test_backend_attends_in_bf16_only_for_models_whose_weights_multiply_in_bf16(tiny_llama_dir):
    """The runner asks for bf16 prefill attention (and a bf16 KV cache) exactly when the weights keep AMX
    bf16-product copies: never for float weights (exact against transformers)."""
    from engine.attention import BF16_PREFILL_MIN_TOKENS, AttentionBackend
    from engine.layers.quantized import cpu_has_amx
    from engine.llm import LLM
    assert AttentionBackend("torch", bf16_prefill=True).bf16_min_tokens == BF16_PREFILL_MIN_TOKENS
    assert AttentionBackend("triton", bf16_prefill=True).bf16_min_tokens is None
    for quantization, expected in (("none", None), ("int4", BF16_PREFILL_MIN_TOKENS if cpu_has_amx() else None)):
        llm = LLM(str(tiny_llama_dir), quantization=quantization, max_model_len=64)
        layers = llm.llm_engine.core.runner.model.attention_layers()
        assert all(layer.backend.bf16_min_tokens == expected for layer in layers)
        # The KV cache follows (--kv-cache-dtype auto): bfloat16 exactly where the weights multiply in bfloat16.
        assert all(layer.k_cache.dtype == (torch.float32 if expected is None else torch.bfloat16) for layer in layers)
    if cpu_has_amx():
        llm = LLM(str(tiny_llama_dir), quantization="int4", max_model_len=64, kv_cache_dtype="float32")
        assert llm.llm_engine.core.runner.model.attention_layers()[0].k_cache.dtype == torch.float32


def test_kv_cache_dtype_is_checked():
    from engine.config import CacheConfig
    assert CacheConfig(cache_dtype="bfloat16").cache_dtype == "bfloat16"
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2': use one of auto, float32, bfloat16, float16, "
                                         "fp8, fp8_e4m3"):
        CacheConfig(cache_dtype="fp8_e5m2")
