"""The CPU layer ops (add + RMSNorm, SiLU-and-mul) against their twins."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_layer_ops import CpuLayerOps
from kernels.reference import rms_norm_ref, rotary_write_kv_ref, silu_and_mul_ref


@pytest.fixture(scope="module")
def ops(tmp_path_factory) -> CpuLayerOps:
    loaded = CpuLayerOps.load(tmp_path_factory.mktemp("cpu_kernels"))
    assert loaded is not None, "the CPU layer ops did not build (is gcc installed?)"
    return loaded


@pytest.mark.parametrize("rows", [1, 3, 16, 130])                # 130: two threads' rows
@pytest.mark.parametrize("hidden", [576, 100])                  # SmolLM2's; one that is not a multiple of 8
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_ref(ops, rows, hidden, with_residual):
    g = torch.Generator().manual_seed(rows * hidden)
    wide = torch.randn(rows, hidden + 64, generator=g)
    x = wide[:, 32:32 + hidden]                                     # strided rows, as a projection slice
    weight = torch.randn(hidden, generator=g)
    residual = torch.randn(rows, hidden, generator=g) if with_residual else None
    if with_residual:
        ref_out, ref_sum = rms_norm_ref(x, weight, 1e-5, residual.clone())
    else:
        ref_out, ref_sum = rms_norm_ref(x, weight, 1e-5), None
    out = ops.add_rms_norm(x, weight, 1e-5, residual, num_threads=2)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    if with_residual:
        torch.testing.assert_close(residual, ref_sum, rtol=0, atol=0)      # written back: x + residual


@pytest.mark.parametrize("rows", [1, 16, 130])
@pytest.mark.parametrize("d", [1536, 13])                        # 13: the scalar tail after 8-wide steps
def test_silu_mul_matches_ref(ops, rows, d):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(rows, 2 * d + 8, generator=g)[:, :2 * d] * 6    # strided rows; gates far into both tails
    x[0, 0], x[-1, 1] = 100.0, -100.0
    out = ops.silu_mul(x, num_threads=2)
    torch.testing.assert_close(out, silu_and_mul_ref(x.clone()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rotary_dim", [64, 32])                   # full, partial (pass-through dims)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv_matches_ref(ops, rotary_dim, padded, cache_dtype):
    """q and k as views of a packed q | k | v projection output, rotated in place; k and v written at their
    slots (slot -1: nothing written, still rotated)."""
    g = torch.Generator().manual_seed(rotary_dim)
    num_tokens, heads, kv_heads, head_dim, block_size = 5, 6, 2, 64, 16
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                                  kv_heads * head_dim], -1))
    positions = torch.tensor([0, 7, 100, 3, 45])
    angles = torch.randn(128, rotary_dim // 2, generator=g)
    cos, sin = angles.cos(), angles.sin()
    k_cache = torch.randn(4, block_size, kv_heads, head_dim, generator=g).to(cache_dtype)
    v_cache = torch.randn(4, block_size, kv_heads, head_dim, generator=g).to(cache_dtype)
    slots = torch.tensor([3, 17, -1 if padded else 18, 40, 63])
    q_ref, k_ref, kc_ref, vc_ref = rotary_write_kv_ref(positions, q.clone(), k.clone(), v, cos, sin, rotary_dim,
                                                       k_cache, v_cache, slots)
    ops.rotary_write_kv(positions, q, k, v, cos, sin, rotary_dim, k_cache, v_cache, slots, num_threads=2)
    for actual, expected in ((q, q_ref), (k, k_ref), (k_cache, kc_ref), (v_cache, vc_ref)):
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)   # bf16: the same rounding


def test_checks_arguments(ops):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight"):
        ops.add_rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        ops.add_rms_norm(x, torch.ones(8), 1e-5, residual=torch.zeros(2, 8).bfloat16())
    with pytest.raises(ValueError, match="x: expected a 2-D float32"):
        ops.silu_mul(x.half())
    with pytest.raises(ValueError, match="x: expected a 2-D float32"):
        ops.add_rms_norm(x.t(), torch.ones(2), 1e-5)
    with pytest.raises(ValueError, match="gate | up"):
        ops.silu_mul(torch.randn(2, 7))
    q, k, cache = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.zeros(3, 4, 2, 8)
    pos, slots, cs = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), torch.ones(4, 4)
    with pytest.raises(ValueError, match="rotary_dim"):
        ops.rotary_write_kv(pos, q, k, k, cs, cs, 7, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.rotary_write_kv(pos, q, k, k, cs, cs, 8, cache, cache.clone(), slots.int())
