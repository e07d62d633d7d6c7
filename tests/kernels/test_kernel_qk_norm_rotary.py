"""Per-head q/k RMSNorm (``kernels.kv_write.QKNormWeights``: Qwen3's and Gemma 3's ``q_norm`` / ``k_norm``)
fused into the rotary + KV write (``rotary_write_kv``) and into the pure-decode attention kernel
(``paged_decode_rotary``), against norm -> rotary -> KV write in torch (``kernels.reference``). CPU tensors
run through the Triton interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_write import QKNormWeights, rotary_write_kv
from kernels.paged_attention import paged_attention, paged_decode_rotary
from kernels.reference import paged_attention_ref, qk_norm_ref, rms_norm_ref, rotary_write_kv_ref
from tests.kernels.test_kernel_paged_decode_rotary import DEVICE, _decode_step, _tables

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
"""Kernels vs the torch twins: float32 within rounding; bfloat16 within a few units in the last place of the
normed values (the mean square summed in another order may round one normed value the other way)."""

HEADS = [(8, 2, 64, 64), (4, 1, 128, 128), (4, 2, 256, 256), (4, 4, 64, 32)]
"""(num_heads, num_kv_heads, head_dim, rotary_dim): GQA, MQA, head dims 64 / 128 / 256, MHA with partial
rotary (the unrotated dims are normed too)."""
DTYPE_PLUS_ONE = [(torch.float32, True), (torch.bfloat16, False)]
"""(dtype, plus_one) pairs: each dtype and each norm form once (the norm's arithmetic does not depend on the dtype
beyond the final rounding, which each dtype's tolerance covers)."""


def _norm_weights(head_dim: int, dtype: torch.dtype, plus_one: bool, seed: int) -> QKNormWeights:
    """Distinct q and k weights (a swap shows), around 0 with plus_one (Gemma's stored w), around 1 without."""
    g = torch.Generator().manual_seed(seed)
    base = 0.0 if plus_one else 1.0
    q_w = (base + 0.5 * torch.randn(head_dim, generator=g)).to(dtype).to(DEVICE)
    k_w = (base + 0.5 * torch.randn(head_dim, generator=g)).to(dtype).to(DEVICE)
    return QKNormWeights(q_w, k_w, 1e-6, plus_one)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_twin_is_the_engine_rms_norm_per_head():
    """``qk_norm_ref`` without the offset is the engine's RMSNorm over each head row; with it, the norm by
    1 + w (transformers' Gemma3RMSNorm in float32)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(64, generator=g).to(torch.bfloat16)
    ref = rms_norm_ref(x.reshape(12, 64), w, 1e-6).view(3, 4, 64)
    assert torch.equal(qk_norm_ref(x, w, 1e-6), ref)
    x32, w32 = x.float(), w.float()
    gemma = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w32)
    torch.testing.assert_close(qk_norm_ref(x32, w32, 1e-6, plus_one=True), gemma, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,plus_one,num_heads,num_kv_heads,head_dim,rotary_dim",
                         [(*DTYPE_PLUS_ONE[i % 2], *heads) for i, heads in enumerate(HEADS)])
def test_rotary_write_kv_with_qk_norm_matches_twin(dtype, num_heads, num_kv_heads, head_dim, rotary_dim, plus_one):
    """q and k normed, rotated and left in place, the normed rotated k and v at each token's slot (a padding
    token, slot -1, writes nothing), every other slot untouched: as norm -> rotary -> KV write in torch."""
    b = _decode_step([3, 17, 40, 9], num_heads, num_kv_heads, head_dim, 16, dtype, seed=head_dim + plus_one)
    b["slot_mapping"][2] = -1
    norm = _norm_weights(head_dim, dtype, plus_one, seed=head_dim)
    cos, sin = _tables(rotary_dim)
    half = rotary_dim // 2
    q_ref, k_ref, kc_ref, vc_ref = rotary_write_kv_ref(b["positions"], b["q"], b["k"], b["v"], cos, sin, rotary_dim,
                                                       b["k_cache"], b["v_cache"], b["slot_mapping"], qk_norm=norm)
    q_plain = rotary_write_kv_ref(b["positions"], b["q"], b["k"], b["v"], cos, sin, rotary_dim, b["k_cache"],
                                  b["v_cache"], b["slot_mapping"])[0]
    assert not torch.allclose(q_plain.float(), q_ref.float(), atol=0.1)     # the norm matters here
    rotary_write_kv(b["positions"], b["q"], b["k"], b["v"], cos[:, :half], sin[:, :half], rotary_dim, b["k_cache"],
                    b["v_cache"], b["slot_mapping"], qk_norm=norm)
    _close(b["q"], q_ref, dtype)
    _close(b["k"], k_ref, dtype)
    _close(b["k_cache"], kc_ref, dtype)
    assert torch.equal(b["v_cache"], vc_ref)


def _fused(b, norm, cos, sin, rotary_dim, scale, **kw):
    half = rotary_dim // 2
    return paged_decode_rotary(b["q"], b["k"], b["v"], b["positions"], cos[:, :half], sin[:, :half], rotary_dim,
                               b["k_cache"], b["v_cache"], b["slot_mapping"], b["query_start_loc"], b["seq_lens"],
                               b["block_tables"], b["max_seq_len"], scale, qk_norm=norm, **kw)


@pytest.mark.parametrize("dtype,plus_one,num_heads,num_kv_heads,head_dim,rotary_dim,num_splits",
                         [(*DTYPE_PLUS_ONE[i % 2], *heads, (1, 4)[i // 2]) for i, heads in enumerate(HEADS)])
def test_decode_rotary_with_qk_norm(dtype, num_heads, num_kv_heads, head_dim, rotary_dim, plus_one, num_splits):
    """The fused decode kernel with the q/k norm: the same cache and output as ``rotary_write_kv`` (norm
    fused) + ``paged_attention``, and as the torch twins (norm -> rotary -> KV write -> attention); q, k, v
    not written. Every head shape once; each (dtype, norm form) pair with and without split-KV."""
    b = _decode_step([1, 16, 33, 50], num_heads, num_kv_heads, head_dim, 16, dtype, seed=head_dim + num_splits)
    norm = _norm_weights(head_dim, dtype, plus_one, seed=head_dim + 1)
    cos, sin = _tables(rotary_dim)
    scale = head_dim ** -0.5
    caches = (b["k_cache"].clone(), b["v_cache"].clone())
    inputs = (b["q"].clone(), b["k"].clone(), b["v"].clone())
    out = _fused(b, norm, cos, sin, rotary_dim, scale, num_splits=num_splits)
    assert all(torch.equal(t, before) for t, before in zip((b["q"], b["k"], b["v"]), inputs))

    q_ref, _, kc_ref, vc_ref = rotary_write_kv_ref(b["positions"], inputs[0], inputs[1], inputs[2], cos, sin,
                                                   rotary_dim, caches[0], caches[1], b["slot_mapping"], qk_norm=norm)
    _close(b["k_cache"], kc_ref, dtype)
    assert torch.equal(b["v_cache"], vc_ref)
    twin = paged_attention_ref(q_ref, kc_ref, vc_ref, b["query_start_loc"], b["seq_lens"], b["block_tables"], scale)
    _close(out, twin, dtype) if dtype == torch.float32 else torch.testing.assert_close(
        out.float(), twin.float(), atol=5e-2, rtol=5e-2)

    # The unfused kernels with the norm in the KV write: the same cache and output (bit-equal under the
    # interpreter, where both compute the mean square and the rotation in the same order).
    fused_k_cache = b["k_cache"].clone()
    k_cache, v_cache = caches[0].clone(), caches[1].clone()
    half = rotary_dim // 2
    q = inputs[0].clone()
    rotary_write_kv(b["positions"], q, inputs[1].clone(), inputs[2], cos[:, :half], sin[:, :half], rotary_dim,
                    k_cache, v_cache, b["slot_mapping"], qk_norm=norm)
    unfused = paged_attention(q, k_cache, v_cache, b["query_start_loc"], b["seq_lens"], b["block_tables"], 1,
                              b["max_seq_len"], scale, num_splits=num_splits)
    if DEVICE.type == "cpu":
        assert torch.equal(fused_k_cache, k_cache)
    else:
        _close(fused_k_cache, k_cache, dtype)
    _close(out, unfused, dtype)


def test_qk_norm_arguments_are_checked():
    b = _decode_step([4, 9], 4, 2, 64, 16, torch.float32, seed=5)
    cos, sin = _tables(64)
    good = _norm_weights(64, torch.float32, False, seed=1)
    bad = [good._replace(q_weight=good.q_weight[:32].contiguous()),          # not [head_dim]
           good._replace(k_weight=good.k_weight.to(torch.bfloat16)),          # not q's dtype
           good._replace(eps=float("nan"))]
    for norm in bad:
        with pytest.raises(ValueError, match="qk_norm"):
            rotary_write_kv(b["positions"], b["q"], b["k"], b["v"], cos[:, :32], sin[:, :32], 64, b["k_cache"],
                            b["v_cache"], b["slot_mapping"], qk_norm=norm)
        with pytest.raises(ValueError, match="qk_norm"):
            _fused(b, norm, cos, sin, 64, 0.125)


def test_warm_up_compiles_the_normed_decode_kernel(monkeypatch):
    """With the model's q/k norms, the start-up warm-up runs the fused decode kernel with them (the variant
    the model's decode steps take), writing nothing."""
    import kernels.paged_attention as pa
    from engine.attention import AttentionBackend
    from engine.kernel_policy import KernelPolicy

    norms = []
    fused = pa.paged_decode_rotary
    monkeypatch.setattr(pa, "paged_decode_rotary",
                        lambda *a, **kw: norms.append(kw.get("qk_norm")) or fused(*a, **kw))
    kc = torch.randn(3, 16, 2, 32, device=DEVICE)
    vc = torch.randn_like(kc)
    before = (kc.clone(), vc.clone())
    norm = _norm_weights(32, torch.float32, False, seed=2)
    backend = AttentionBackend("triton", KernelPolicy(decode_fuse_rotary="1"))
    backend.warm_up(kc, vc, 4, 32 ** -0.5, rotary_dim=32, qk_norm=norm)
    assert len(norms) == 3 and all(n is norm for n in norms)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


@pytest.mark.parametrize("num_splits", [1, 2])
def test_fp8_cache_gets_the_normed_keys(num_splits):
    """An FP8 cache: the fused decode kernel and ``rotary_write_kv`` quantize the same normed, rotated k (and
    v) into it, and the decode attends what it stored, as ``paged_attention`` does after the unfused write."""
    from kernels.kv_write import FP8_KV_DTYPE, fp8_quantize_ref

    k_scale, v_scale = 0.5, 0.25
    b = _decode_step([5, 33, 17], 4, 2, 64, 16, torch.bfloat16, seed=7)
    b["k_cache"], b["v_cache"] = fp8_quantize_ref(b["k_cache"], k_scale), fp8_quantize_ref(b["v_cache"], v_scale)
    assert b["k_cache"].dtype == FP8_KV_DTYPE
    norm = _norm_weights(64, torch.bfloat16, True, seed=3)
    cos, sin = _tables(64)
    k_cache, v_cache, q = b["k_cache"].clone(), b["v_cache"].clone(), b["q"].clone()
    rotary_write_kv(b["positions"], q, b["k"].clone(), b["v"], cos[:, :32], sin[:, :32], 64, k_cache, v_cache,
                    b["slot_mapping"], k_scale=k_scale, v_scale=v_scale, qk_norm=norm)
    unfused = paged_attention(q, k_cache, v_cache, b["query_start_loc"], b["seq_lens"], b["block_tables"], 1,
                              b["max_seq_len"], 0.125, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)
    out = _fused(b, norm, cos, sin, 64, 0.125, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(b["v_cache"].view(torch.uint8), v_cache.view(torch.uint8))
    if DEVICE.type == "cpu":                        # on CUDA the two kernels' sums may round differently
        assert torch.equal(b["k_cache"].view(torch.uint8), k_cache.view(torch.uint8))
    torch.testing.assert_close(out.float(), unfused.float(), atol=5e-2, rtol=5e-2)
