"""Fused layer ops (add + RMSNorm, rotary, SiLU-and-mul): Triton kernels against their torch twins,
the CPU implementations in engine/layers. CPU tensors run through the interpreter."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from engine.layers.activation import silu_and_mul_torch
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from kernels.layer_ops import add_rms_norm, rotary_embedding_, silu_and_mul

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _tol(dtype):
    # Two roundings may land one ulp apart (the interpreter truncates fp32 -> bf16).
    return dict(float32=(1e-5, 1e-5), float16=(2e-3, 2e-3), bfloat16=(2e-2, 2e-2))[str(dtype).split(".")[1]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 200])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype, hidden, with_residual):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=g).to(dtype).to(DEVICE)
    res = torch.randn(7, hidden, generator=g).to(dtype).to(DEVICE)
    norm = RMSNorm(hidden, 1e-5).to(DEVICE)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    rtol, atol = _tol(dtype)
    if with_residual:
        ref_out, ref_res = norm.forward_torch(x.clone(), res.clone())
        res_k = res.clone()
        out = add_rms_norm(x.clone(), norm.weight, 1e-5, residual=res_k)
        torch.testing.assert_close(res_k.float(), ref_res.float(), rtol=rtol, atol=atol)
    else:
        ref_out = norm.forward_torch(x)
        out = add_rms_norm(x, norm.weight, 1e-5)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=rtol, atol=atol)


def test_add_rms_norm_in_place():
    x = torch.randn(5, 64, device=DEVICE)
    res = torch.randn(5, 64, device=DEVICE)
    w = torch.rand(64, device=DEVICE) + 0.5
    norm = RMSNorm(64, 1e-6).to(DEVICE)
    norm.weight.data = w
    ref_out, ref_res = norm.forward_torch(x.clone(), res.clone())
    out = add_rms_norm(x, w, 1e-6, residual=res, out=x)
    assert out.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res, ref_res, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_parts", [2, 3])
@pytest.mark.parametrize("part_dtype,dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                              (torch.float32, torch.float32)])
def test_add_rms_norm_sums_split_k_partials(num_parts, part_dtype, dtype):
    """x as [num_parts, T, hidden] partial products: summed in float32 in order, then the
    residual add and the norm, as the twin does; the residual takes the rounded sum."""
    g = torch.Generator().manual_seed(num_parts)
    parts = torch.randn(num_parts, 6, 96, generator=g).to(part_dtype).to(DEVICE)
    res = torch.randn(6, 96, generator=g).to(dtype).to(DEVICE)
    norm = RMSNorm(96, 1e-5).to(DEVICE)
    norm.weight.data = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype).to(DEVICE)
    ref_out, ref_res = norm.forward_torch(parts, res.clone())
    expect_sum = (sum(p.float() for p in parts) + res.float()).to(dtype)
    torch.testing.assert_close(ref_res, expect_sum, rtol=0, atol=0)      # the twin's own semantics
    res_k = res.clone()
    out = add_rms_norm(parts, norm.weight, 1e-5, residual=res_k)
    rtol, atol = _tol(dtype)
    assert out.shape == (6, 96) and out.dtype == dtype
    torch.testing.assert_close(res_k.float(), ref_res.float(), rtol=rtol, atol=atol)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=rtol, atol=atol)
    with pytest.raises(ValueError, match="need a residual"):
        add_rms_norm(parts, norm.weight, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,partial",
                         [(4, 2, 16, 1.0), (6, 1, 24, 1.0), (4, 4, 32, 0.5), (3, 3, 80, 1.0)])
def test_rotary(dtype, heads, kv_heads, head_dim, partial):
    cfg = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      partial_rotary_factor=partial, rope_theta=10000.0, max_position_embeddings=256)
    rope = RotaryEmbedding(cfg, head_dim, 256).to(DEVICE)
    g = torch.Generator().manual_seed(head_dim)
    num_tokens = 9
    # q and k as views of one packed qkv row, as the model passes them.
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(DEVICE)
    q = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 17, 31, 64, 100, 200, 255], device=DEVICE)
    ref_q, ref_k = rope.forward_torch(positions, q.float().clone(), k.float().clone())
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    half = rope.rotary_dim // 2
    rotary_embedding_(positions, q, k, rope.cos[:, :half], rope.sin[:, :half], rope.rotary_dim)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(q.float(), ref_q, rtol=rtol, atol=atol)
    torch.testing.assert_close(k.float(), ref_k, rtol=rtol, atol=atol)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)   # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [8, 40, 1500])
def test_silu_and_mul(dtype, d):
    g = torch.Generator().manual_seed(d)
    x = (2 * torch.randn(5, 2 * d, generator=g)).to(dtype).to(DEVICE)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(silu_and_mul(x).float(), silu_and_mul_torch(x).float(), rtol=rtol, atol=atol)


def test_checks_reject_bad_inputs():
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(torch.randn(2, 8, device=DEVICE), torch.ones(4, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 7, device=DEVICE))
    q = torch.randn(2, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_embedding_(torch.zeros(2, dtype=torch.long, device=DEVICE), q, q.clone(),
                          torch.ones(4, 4, device=DEVICE), torch.ones(4, 4, device=DEVICE), 7)
