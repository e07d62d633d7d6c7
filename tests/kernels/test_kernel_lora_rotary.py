"""The q/k/v LoRA expand fused into rotary + KV write (``kernels.lora_rotary_write_kv``) against its
twin (expand, then rotary + write), on CPU through the interpreter; real sizes on CUDA."""

from __future__ import annotations

import pytest
import torch

from kernels.lora_expand import slotwise_buf
from kernels.lora_rotary_write_kv import lora_rotary_write_kv
from kernels.reference import lora_rotary_write_kv_ref
from tests.kernels.test_kernel_kv_write import DEVICE, _rotary_tables, make_step
from tests.kernels.pairwise import pairwise

SHAPES = [(4, 2, 16, 16), (6, 2, 24, 12), (4, 4, 80, 80), (8, 1, 32, 20)]
"""(num_heads, num_kv_heads, head_dim, rotary_dim): GQA, partial rotary, MHA, MQA."""


def run_case(dtype, num_heads, num_kv_heads, head_dim, rotary_dim, pad, slotwise, num_tokens=7, rank=8,
             max_loras=3, seed=0, cache_dtype=None, kv_scales=(1.0, 1.0)):
    """One call of the kernel and of its twin -> (q, k, v, k_cache, v_cache) after the kernel, the twin's
    same five (its caches hold the plain casts: an FP8 cache's quantized values are checked by the caller),
    slot_mapping, token_lora_slots."""
    k, v, kc, vc, slots = make_step(num_tokens=num_tokens, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                    dtype=dtype, cache_dtype=cache_dtype, pad=pad, seed=seed + num_heads + head_dim,
                                    num_blocks=64)
    g = torch.Generator().manual_seed(seed + 1)
    widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.randn(num_tokens, sum(widths), generator=g).to(dtype).to(DEVICE)      # packed, strided views
    q, kk, vv = (t.view(num_tokens, -1, head_dim) for t in qkv.split(widths, -1))
    lslots = torch.tensor([(i % (max_loras + 1)) - 1 for i in range(num_tokens)], dtype=torch.int32,
                          device=DEVICE)                                              # -1 (base), 0, 1, 2, ...
    lora_b = [(torch.randn(max_loras, w, rank, generator=g) / rank).to(dtype).to(DEVICE) for w in widths]
    h_all = torch.randn(num_tokens, max_loras, 3, rank, generator=g).to(DEVICE)        # every slot's h
    own = torch.zeros(3, 1, num_tokens, rank, device=DEVICE)                           # [3, 1, T, R] f32
    for t, s in enumerate(lslots.tolist()):
        if s >= 0:
            own[:, 0, t] = h_all[t, s]
    positions = torch.tensor([0, 3, 17, 31, 32, 200, 299, 5, 9][:num_tokens], dtype=torch.int64, device=DEVICE)
    cos, sin = _rotary_tables(rotary_dim)
    half = rotary_dim // 2
    want = lora_rotary_write_kv_ref(positions, q, kk, vv, cos, sin, rotary_dim, kc, vc, slots, own, lora_b, lslots)
    if slotwise:
        buf, slot_stride = slotwise_buf(h_all)
    else:   # split partials that sum to h
        buf, slot_stride = torch.stack([own[:, 0] * 0.25, own[:, 0] * 0.75], dim=1), 0       # [3, 2, T, R]
    lora_rotary_write_kv(positions, q, kk, vv, cos[:, :half], sin[:, :half], rotary_dim, kc, vc, slots, buf,
                         lora_b, lslots, slot_stride, k_scale=kv_scales[0], v_scale=kv_scales[1])
    return (q, kk, vv, kc, vc), want, slots, lslots


SHAPE_NAMES = ["gqa", "partial", "mha", "mqa"]


@pytest.mark.parametrize("dtype,shape,form", pairwise([torch.float32, torch.bfloat16], SHAPE_NAMES,
                                                      ["slotwise", "partials-pad"]))
def test_matches_ref(dtype, shape, form):
    """q/k/v updated then rotated in place, k (rotated) and v (updated) in the cache; base-model
    rows (slot -1) get the plain rotary + write; padding rows write no cache; every pair of dtype,
    head shape and form."""
    shape = SHAPES[SHAPE_NAMES.index(shape)]
    pad, slotwise = ((), True) if form == "slotwise" else ((1, 5), False)
    got, want, slots, lslots = run_case(dtype, *shape, pad, slotwise)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for name, a, b in zip(("q", "k", "v", "k_cache", "v_cache"), got, want):
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m: f"{name}: {m}")
    q, kk, vv, kc, vc = got
    num_kv_heads, head_dim = kk.shape[1], kk.shape[2]
    for t, slot in enumerate(slots.tolist()):       # the cache holds exactly what was left in place
        if slot >= 0:
            assert torch.equal(kc.view(-1, num_kv_heads, head_dim)[slot], kk[t].to(kc.dtype))
            assert torch.equal(vc.view(-1, num_kv_heads, head_dim)[slot], vv[t].to(vc.dtype))


def test_adapter_changes_the_rows():
    """The update is really added: v of a LoRA row moves by h . B (here 4 per column), a base row's
    not; q of the LoRA row is not its plain rotation."""
    from kernels.kv_write import rotary_write_kv

    k, v, kc, vc, slots = make_step(num_tokens=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, num_blocks=8)
    q = torch.randn(2, 4, 16, device=DEVICE)
    pos = torch.tensor([1, 2], device=DEVICE)
    cos, sin = _rotary_tables(16)
    b = [torch.ones(1, w, 4, device=DEVICE) for w in (64, 32, 32)]
    buf = torch.ones(3, 1, 2, 4, device=DEVICE)
    q0, v0 = q.clone(), v.clone()
    lora_rotary_write_kv(pos, q, k, v, cos[:, :8], sin[:, :8], 16, kc, vc, slots, buf, b,
                         torch.tensor([-1, 0], dtype=torch.int32, device=DEVICE))
    assert torch.equal(v[0], v0[0]) and torch.allclose(v[1], v0[1] + 4)     # h . B = 4 per column
    q_plain = q0.clone()
    rotary_write_kv(pos, q_plain, k.clone(), v0.clone(), cos[:, :8], sin[:, :8], 16, kc.clone(), vc.clone(), slots)
    assert torch.equal(q[0], q_plain[0]) and not torch.allclose(q[1], q_plain[1])


def test_rejects_bad_inputs():
    k, v, kc, vc, slots = make_step(num_tokens=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, num_blocks=8)
    q = torch.randn(2, 4, 16, device=DEVICE)
    pos = torch.tensor([1, 2], device=DEVICE)
    cos, sin = _rotary_tables(16)
    b = [torch.ones(1, w, 4, device=DEVICE) for w in (64, 32, 32)]
    lslots = torch.tensor([-1, 0], dtype=torch.int32, device=DEVICE)
    args = (pos, q, k, v, cos[:, :8], sin[:, :8], 16, kc, vc, slots)
    with pytest.raises(ValueError, match="buf"):
        lora_rotary_write_kv(*args, torch.ones(2, 1, 2, 4, device=DEVICE), b, lslots)
    with pytest.raises(ValueError, match="B_k"):
        lora_rotary_write_kv(*args, torch.ones(3, 1, 2, 4, device=DEVICE), [b[0], b[0], b[2]], lslots)
    with pytest.raises(ValueError, match="token_lora_slots"):
        lora_rotary_write_kv(*args, torch.ones(3, 1, 2, 4, device=DEVICE), b, lslots.long())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("slotwise", [True, False])
def test_gpu_llama3_sizes(slotwise):
    """Llama-3-8B heads (32 / 8 x 128), 9 decode tokens over 8 adapters, rank 16, bf16."""
    got, want, _, _ = run_case(torch.bfloat16, 32, 8, 128, 128, (3,), slotwise, num_tokens=9, rank=16,
                               max_loras=8)
    for name, a, b in zip(("q", "k", "v", "k_cache", "v_cache"), got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=2e-2, msg=lambda m: f"{name}: {m}")
