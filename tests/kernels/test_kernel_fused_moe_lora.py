"""Fused MoE with per-token LoRA on the experts (``kernels.fused_moe_lora``) against its torch twin
``engine.layers.moe.fused_moe_lora_ref``, and the twin against a per-token loop over merged weights
(W + B @ A per (adapter, expert)). CPU tensors run through the interpreter with tiny shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.moe import ExpertLoRAWeights, fused_moe_lora_ref, fused_moe_ref, select_experts
from kernels.fused_moe import FusedMoEConfig, dequantize_fp8_experts
from kernels.fused_moe_lora import fused_moe_lora_triton, moe_lora_groups
from tests.kernels.test_kernel_fused_moe import fp8_bad_scales, quantize_experts_fp8

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _tol(dtype):
    # bfloat16: the interpreter truncates float32 -> bfloat16 where torch rounds to nearest (see
    # test_kernel_fused_moe), at a few more roundings here (h, each delta).
    return dict(float32=(1e-4, 1e-5), bfloat16=(4e-2, 6e-2))[str(dtype).split(".")[1]]


def _case(T, E, K, H, I, L, R, dtype, slots, seed=0):
    """(hidden, w13, w2, topk_weights, topk_ids, ExpertLoRAWeights) with token t on slot slots[t % len]."""
    g = torch.Generator().manual_seed(seed + 1000 * T + 100 * E + 10 * K + L)

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)

    hidden = rnd(T, H, scale=1.0)
    w13, w2 = rnd(E, 2 * I, H, scale=H ** -0.5), rnd(E, H, I, scale=I ** -0.5)
    logits = torch.randn(T, E, generator=g)
    topk_weights, topk_ids = select_experts(logits.to(DEVICE), K, renormalize=True)
    a13, b13 = rnd(L, E, 2 * R, H, scale=H ** -0.5), rnd(L, E, 2, I, R, scale=R ** -0.5)
    a2, b2 = rnd(L, E, R, I, scale=I ** -0.5), rnd(L, E, H, R, scale=R ** -0.5)
    token_slots = torch.tensor([slots[t % len(slots)] for t in range(T)], dtype=torch.int32, device=DEVICE)
    return hidden, w13, w2, topk_weights, topk_ids, ExpertLoRAWeights(token_slots, a13, b13, a2, b2)


def _merged_loop(hidden, w13, w2, topk_weights, topk_ids, lora: ExpertLoRAWeights):
    """Per token and expert, the merged weights W + B @ A (float32): what PEFT computes."""
    I, R = w2.shape[2], lora.a2.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(hidden.shape[0]):
        x, slot = hidden[t].float().cpu(), int(lora.token_slots[t])
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            wg, wu, wd = w13[e, :I].float().cpu(), w13[e, I:].float().cpu(), w2[e].float().cpu()
            if slot >= 0:
                a13, b13 = lora.a13[slot, e].float().cpu(), lora.b13[slot, e].float().cpu()
                wg = wg + b13[0] @ a13[:R]
                wu = wu + b13[1] @ a13[R:]
                wd = wd + lora.b2[slot, e].float().cpu() @ lora.a2[slot, e].float().cpu()
            out[t] += float(topk_weights[t, k]) * (wd @ (F.silu(wg @ x) * (wu @ x)))
    return out


@pytest.mark.parametrize("slots", [[-1], [0], [1, -1, 0], [2, 2, -1, 1]], ids=["base", "one", "mixed", "three"])
def test_ref_equals_merged_weights(slots):
    args = _case(9, 8, 2, 32, 16, 3, 4, torch.float32, slots)
    ref = fused_moe_lora_ref(*args)
    torch.testing.assert_close(ref.cpu(), _merged_loop(*args), rtol=1e-4, atol=1e-5)
    if slots == [-1]:                                     # no adapter: exactly the plain MoE
        assert torch.equal(ref, fused_moe_ref(*args[:5]))
    else:
        assert not torch.allclose(ref, fused_moe_ref(*args[:5]), atol=1e-3)   # the adapters change the output


@pytest.mark.parametrize("T,E,K,L,R,slots,dtype", [(1, 8, 2, 1, 4, [0], torch.float32),
                                                   (7, 8, 2, 2, 8, [1, -1, 0], torch.bfloat16),
                                                   (20, 4, 4, 3, 4, [2, -1, -1, 0, 1], torch.float32),
                                                   (20, 4, 4, 3, 4, [2, -1, -1, 0, 1], torch.bfloat16),
                                                   (5, 8, 1, 2, 4, [-1], torch.bfloat16)])
def test_kernel_matches_ref(T, E, K, L, R, slots, dtype):
    """Each routing and slot pattern once, the mixed-slot batches in both dtypes."""
    args = _case(T, E, K, 48, 32, L, R, dtype, slots)
    lora = args[5]
    before = [a.clone() for a in (*args[:5], lora.token_slots, lora.a13, lora.b13, lora.a2, lora.b2)]
    out = fused_moe_lora_triton(*args[:5], lora.token_slots, lora.a13, lora.b13, lora.a2, lora.b2)
    ref = fused_moe_lora_ref(*args)
    assert out.dtype == dtype and out.shape == args[0].shape
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)
    after = (*args[:5], lora.token_slots, lora.a13, lora.b13, lora.a2, lora.b2)
    assert all(torch.equal(a, b) for a, b in zip(after, before))        # inputs untouched


def test_kernel_tails_and_block_size():
    """N/K tails (H = 40, I = 24 with 32-wide tiles), rank 2 (a K tail in the expand), block_m 32, int64 slots."""
    args = _case(11, 8, 2, 40, 24, 2, 2, torch.float32, [0, 1, -1])
    lora = args[5]
    config = FusedMoEConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)
    out = fused_moe_lora_triton(*args[:5], lora.token_slots.long(), lora.a13, lora.b13, lora.a2, lora.b2,
                                config=config)
    torch.testing.assert_close(out, fused_moe_lora_ref(*args), rtol=1e-4, atol=1e-5)


def _fp8_case(T, E, K, H, inter, L, R, dtype, slots, block):
    """``_case`` with w13 / w2 quantized to e4m3 (``quantize_experts_fp8``; the float weights drawn in
    float32), the hidden states and LoRA weights in dtype: (args, the FP8 keywords)."""
    hidden, w13, w2, topk_weights, topk_ids, lora = _case(T, E, K, H, inter, L, R, torch.float32, slots)
    q13, s13 = quantize_experts_fp8(w13, block)
    q2, s2 = quantize_experts_fp8(w2, block)
    lora = ExpertLoRAWeights(lora.token_slots, *(t.to(dtype) for t in (lora.a13, lora.b13, lora.a2, lora.b2)))
    return (hidden.to(dtype), q13, q2, topk_weights, topk_ids, lora), dict(w13_scale=s13, w2_scale=s2,
                                                                           scale_block=block)


@pytest.mark.parametrize("block,dtype,T,H,inter,slots", [
    (None, torch.bfloat16, 7, 48, 32, [1, -1, 0]),
    (None, torch.float32, 5, 48, 32, [0, 1]),
    ((16, 32), torch.bfloat16, 7, 64, 32, [1, -1, 0]),
    ((16, 32), torch.float32, 3, 64, 32, [-1, 1]),
    ((24, 32), torch.bfloat16, 9, 40, 24, [0, -1, 1]),      # ragged: 2I, H, I not block multiples
    ((24, 32), torch.float32, 9, 40, 24, [0, -1, 1]),
], ids=["ch-bf16", "ch-f32", "blk-bf16", "blk-f32", "ragged-bf16", "ragged-f32"])
def test_kernel_fp8_matches_ref(block, dtype, T, H, inter, slots):
    """FP8 base experts (per channel, per block) with LoRA in the activation dtype, against the twin on the
    dequantized weights."""
    args, scales = _fp8_case(T, 8, 2, H, inter, 2, 4, dtype, slots, block)
    hidden, w13, w2, topk_weights, topk_ids, lora = args
    out = fused_moe_lora_triton(hidden, w13, w2, topk_weights, topk_ids, lora.token_slots, lora.a13, lora.b13,
                                lora.a2, lora.b2, **scales)
    deq13 = dequantize_fp8_experts(w13, scales["w13_scale"], block, dtype)
    deq2 = dequantize_fp8_experts(w2, scales["w2_scale"], block, dtype)
    ref = fused_moe_lora_ref(hidden, deq13, deq2, topk_weights, topk_ids, lora)
    assert out.dtype == dtype and out.shape == hidden.shape
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


def test_fp8_block_k_clamped():
    """Config block_k 64 with BK 16: the base GEMMs' K tile is clamped to 16 (the LoRA GEMMs keep 64)."""
    args, scales = _fp8_case(11, 8, 2, 40, 24, 2, 2, torch.float32, [0, 1, -1], (32, 16))
    hidden, w13, w2, topk_weights, topk_ids, lora = args
    config = FusedMoEConfig(block_m=32, block_n=32, block_k=64, group_m=2, num_warps=4, num_stages=1)
    out = fused_moe_lora_triton(hidden, w13, w2, topk_weights, topk_ids, lora.token_slots, lora.a13, lora.b13,
                                lora.a2, lora.b2, config=config, **scales)
    deq13 = dequantize_fp8_experts(w13, scales["w13_scale"], (32, 16), torch.float32)
    deq2 = dequantize_fp8_experts(w2, scales["w2_scale"], (32, 16), torch.float32)
    torch.testing.assert_close(out, fused_moe_lora_ref(hidden, deq13, deq2, topk_weights, topk_ids, lora),
                               rtol=1e-4, atol=1e-5)


def test_fp8_checks_reject_bad_inputs():
    args, scales = _fp8_case(3, 8, 2, 64, 32, 2, 4, torch.float32, [0], (16, 32))
    hidden, w13, w2, w, ids, lora = args
    adapters = (lora.token_slots, lora.a13, lora.b13, lora.a2, lora.b2)
    for change, match in fp8_bad_scales(scales):
        with pytest.raises(ValueError, match=match):
            fused_moe_lora_triton(hidden, w13, w2, w, ids, *adapters, **{**scales, **change})
    with pytest.raises(ValueError, match="w13: dtype"):                            # fp8 weights, no scales
        fused_moe_lora_triton(hidden, w13, w2, w, ids, *adapters)
    with pytest.raises(ValueError, match="a13: dtype"):              # LoRA weights: the activation dtype
        fused_moe_lora_triton(hidden, w13, w2, w, ids, lora.token_slots, lora.a13.to(torch.float8_e4m3fn),
                              lora.b13, lora.a2, lora.b2, **scales)


def test_groups():
    ids = torch.tensor([[0, 3], [2, 1], [3, 0]])
    groups = moe_lora_groups(ids, torch.tensor([-1, 0, 2], dtype=torch.int32), 4)
    assert groups.tolist() == [[0, 3], [6, 5], [15, 12]]


def test_checks_reject_bad_inputs():
    args = _case(3, 8, 2, 32, 16, 2, 4, torch.float32, [0])
    hidden, w13, w2, w, ids, lora = args
    good = dict(token_slots=lora.token_slots, a13=lora.a13, b13=lora.b13, a2=lora.a2, b2=lora.b2)
    for change, match in [(dict(token_slots=lora.token_slots[:2]), "token_slots: expected shape"),
                          (dict(a13=lora.a13[:, :4].contiguous()), "a13: expected shape"),
                          (dict(b13=lora.b13[..., :2].contiguous()), "b13: expected shape"),
                          (dict(a2=lora.a2.double()), "a2: dtype"),
                          (dict(b2=lora.b2.transpose(0, 1)), "b2: expected shape")]:
        with pytest.raises(ValueError, match=match):
            fused_moe_lora_triton(hidden, w13, w2, w, ids, **{**good, **change})


# ----------------------------------------------------------------------------------------
# CUDA: MoE-model sizes, and a CUDA-graph capture (no host read)
# ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 7, 256])
@pytest.mark.parametrize("E,K,H,I", [(60, 4, 2048, 1408), (8, 2, 1024, 3584)])
def test_gpu_real_sizes(T, E, K, H, I):
    args = _case(T, E, K, H, I, 4, 16, torch.bfloat16, [0, -1, 3, 1])
    lora = args[5]
    out = fused_moe_lora_triton(*args[:5], lora.token_slots, lora.a13, lora.b13, lora.a2, lora.b2)
    torch.testing.assert_close(out.float(), fused_moe_lora_ref(*args).float(), rtol=3e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graph_capture():
    """The call captures in a CUDA graph and replays with new routing and new slots."""
    hidden, w13, w2, w, ids, lora = _case(16, 60, 4, 2048, 1408, 4, 16, torch.bfloat16, [0, -1, 3])
    call = (lambda: fused_moe_lora_triton(hidden, w13, w2, w, ids, lora.token_slots, lora.a13, lora.b13,
                                          lora.a2, lora.b2))
    call()                                                                         # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    _, _, _, w_new, ids_new, lora_new = _case(16, 60, 4, 2048, 1408, 4, 16, torch.bfloat16, [2, 1, -1], seed=5)
    w.copy_(w_new)
    ids.copy_(ids_new)
    lora.token_slots.copy_(lora_new.token_slots)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), fused_moe_lora_ref(hidden, w13, w2, w, ids, lora).float(),
                               rtol=3e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 64])
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["channel", "block128"])
def test_gpu_fp8_real_sizes(T, block):
    """Qwen3-30B-A3B-FP8 layer sizes (E 128, K 8, H 2048, I 768) with rank-16 adapters on 4 slots."""
    args, scales = _fp8_case(T, 128, 8, 2048, 768, 4, 16, torch.bfloat16, [0, -1, 3, 1], block)
    hidden, w13, w2, topk_weights, topk_ids, lora = args
    out = fused_moe_lora_triton(hidden, w13, w2, topk_weights, topk_ids, lora.token_slots, lora.a13, lora.b13,
                                lora.a2, lora.b2, **scales)
    deq13 = dequantize_fp8_experts(w13, scales["w13_scale"], block, torch.bfloat16)
    deq2 = dequantize_fp8_experts(w2, scales["w2_scale"], block, torch.bfloat16)
    torch.testing.assert_close(out.float(), fused_moe_lora_ref(hidden, deq13, deq2, topk_weights, topk_ids,
                                                               lora).float(), rtol=3e-2, atol=5e-2)
