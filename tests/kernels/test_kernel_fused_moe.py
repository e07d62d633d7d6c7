"""Fused MoE (``kernels.fused_moe``): ``moe_align``'s invariants and the two grouped-GEMM launches against
their torch twin ``engine.layers.moe.fused_moe_ref``. CPU tensors run through the interpreter with tiny
shapes and 16/32-wide tiles; the CUDA tests run MoE-model sizes and a CUDA-graph capture."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from engine.layers.moe import fused_moe_ref, select_experts
from kernels.fused_moe import (FusedMoEConfig, dequantize_fp8_experts, fused_moe_config, fused_moe_triton,
                               moe_align, moe_align_size)
from tests.kernels.pairwise import pairwise

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EMPTY_EXPERT = 3
"""No token routes to this expert in ``_case`` (its logit is -inf): a segment of length zero."""


def _tol(dtype):
    # bfloat16: the interpreter truncates float32 -> bfloat16 where torch rounds to nearest, at each of
    # the intermediate roundings (gate, up, silu, product, down, weighted): a few ulps apart at |y| ~ 1.
    return dict(float32=(1e-4, 1e-5), bfloat16=(3e-2, 5e-2))[str(dtype).split(".")[1]]


def _case(T: int, E: int, K: int, H: int, I: int, dtype, seed: int = 0, strided: bool = False,
          ids_dtype=torch.int64, renormalize: Optional[bool] = None):
    """(hidden, w13, w2, topk_weights, topk_ids) with expert ``EMPTY_EXPERT`` never routed to; the routing
    weights renormalised over the top K when ``renormalize`` (None: when K > 1)."""
    g = torch.Generator().manual_seed(seed + 1000 * T + 100 * E + 10 * K)
    buf = torch.randn(T, H + (16 if strided else 0), generator=g).to(dtype)
    hidden = (buf[:, 8:8 + H] if strided else buf).to(DEVICE)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype).to(DEVICE)
    logits = torch.randn(T, E, generator=g)
    logits[:, EMPTY_EXPERT] = float("-inf")
    renormalize = K > 1 if renormalize is None else renormalize
    topk_weights, topk_ids = select_experts(logits.to(DEVICE), K, renormalize)
    return hidden, w13, w2, topk_weights, topk_ids.to(ids_dtype)


def _check(args, config=None, fn=fused_moe_triton):
    """``fn(*args, config=config)`` (a fused MoE wrapper) against ``fused_moe_ref``; returns its output."""
    hidden = args[0]
    before = [a.clone() for a in args]
    out = fn(*args, config=config)
    ref = fused_moe_ref(*args)
    assert out.dtype == hidden.dtype and out.shape == hidden.shape and out.is_contiguous()
    rtol, atol = _tol(hidden.dtype)
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)
    for a, b in zip(args, before):                         # inputs untouched
        assert torch.equal(a, b)
    return out


def quantize_experts_fp8(w: torch.Tensor, block: Optional[tuple[int, int]] = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8 [E, N, K] float8_e4m3fn, scale float32) of float expert weights w [E, N, K] (on CPU, moved to
    DEVICE): amax / 448 scales per output channel [E, N], or per (BN, BK) block [E, cdiv(N, BN), cdiv(K, BK)]
    (ragged edge blocks take the amax of what they hold)."""
    wf = w.float().cpu()
    E, N, K = wf.shape
    if block is None:
        scale = (wf.abs().amax(dim=2) / 448.0).clamp(min=1e-12)                       # [E, N]
        full = scale[:, :, None]
    else:
        bn, bk = block
        nb, kb = -(-N // bn), -(-K // bk)
        padded = torch.zeros(E, nb * bn, kb * bk)
        padded[:, :N, :K] = wf
        amax = padded.view(E, nb, bn, kb, bk).abs().amax(dim=(2, 4))                  # [E, nb, kb]
        scale = (amax / 448.0).clamp(min=1e-12)
        full = scale.repeat_interleave(bn, dim=1)[:, :N].repeat_interleave(bk, dim=2)[:, :, :K]
    w_fp8 = (wf / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).contiguous()
    return w_fp8.to(DEVICE), scale.float().contiguous().to(DEVICE)


def fp8_case(T: int, E: int, K: int, H: int, inter: int, dtype, block: Optional[tuple[int, int]],
             seed: int = 0, **kwargs):
    """``_case``'s (hidden, w13, w2, topk_weights, topk_ids) with w13 / w2 quantized to e4m3
    (``quantize_experts_fp8``), and the wrappers' FP8 keywords (w13_scale, w2_scale, scale_block)."""
    hidden, w13, w2, topk_weights, topk_ids = _case(T, E, K, H, inter, torch.float32, seed, **kwargs)
    q13, s13 = quantize_experts_fp8(w13, block)
    q2, s2 = quantize_experts_fp8(w2, block)
    hidden = hidden.to(dtype)
    return (hidden, q13, q2, topk_weights, topk_ids), dict(w13_scale=s13, w2_scale=s2, scale_block=block)


def check_fp8(args, scales, config=None, fn=fused_moe_triton):
    """``fn(*args, config=config, **scales)`` (a fused MoE wrapper on FP8 weights) against ``fused_moe_ref``
    on the dequantized weights (``dequantize_fp8_experts`` in hidden's dtype); returns its output."""
    hidden, w13, w2, topk_weights, topk_ids = args
    inputs = (*args, scales["w13_scale"], scales["w2_scale"])
    before = [_bits(a).clone() for a in inputs]
    out = fn(*args, config=config, **scales)
    block, dtype = scales["scale_block"], hidden.dtype
    ref = fused_moe_ref(hidden, dequantize_fp8_experts(w13, scales["w13_scale"], block, dtype),
                        dequantize_fp8_experts(w2, scales["w2_scale"], block, dtype), topk_weights, topk_ids)
    assert out.dtype == hidden.dtype and out.shape == hidden.shape and out.is_contiguous()
    rtol, atol = _tol(hidden.dtype)
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)
    assert all(torch.equal(_bits(a), b) for a, b in zip(inputs, before))          # inputs untouched
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t, an fp8 tensor as its bytes (torch.equal has no float8 kernel on every device)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


# ----------------------------------------------------------------------------------------
# moe_align
# ----------------------------------------------------------------------------------------
def _check_align(topk_ids: torch.Tensor, E: int, block_m: int):
    sorted_ids, expert_of_block, num_valid = moe_align(topk_ids, E, block_m)
    T, K = topk_ids.shape
    n = T * K
    P = moe_align_size(n, E, block_m)
    assert sorted_ids.shape == (P,) and expert_of_block.shape == (P // block_m,) and num_valid.shape == (1,)
    assert P % block_m == 0 and P >= n + E * (block_m - 1)
    flat = topk_ids.reshape(-1).cpu().long()
    sorted_ids, expert_of_block, nv = sorted_ids.cpu(), expert_of_block.cpu(), int(num_valid.item())
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    assert nv == int(padded.sum()) and nv % block_m == 0
    # every pair exactly once, the rest the sentinel
    real = sorted_ids[sorted_ids < n]
    assert torch.equal(real.sort().values, torch.arange(n))
    assert torch.all((sorted_ids == n) | (sorted_ids < n))
    assert torch.all(sorted_ids[nv:] == n)
    # blocks: real ones carry their expert (ascending), the rest -1
    nb = nv // block_m
    assert torch.all(expert_of_block[nb:] == -1)
    assert torch.all(expert_of_block[:nb] >= 0) and torch.all(expert_of_block[:nb].diff() >= 0)
    for b in range(nb):
        blk = sorted_ids[b * block_m:(b + 1) * block_m]
        pairs = blk[blk < n]
        assert pairs.numel() > 0                                     # no all-padding block among the real ones
        assert torch.all(flat[pairs] == expert_of_block[b])
    # each expert: its pairs ascending, ceil(count / block_m) blocks, padding at its segment's end
    for e in range(E):
        blocks = (expert_of_block == e).nonzero().flatten()
        assert blocks.numel() == int(padded[e]) // block_m
        if blocks.numel():
            seg = sorted_ids[int(blocks[0]) * block_m:(int(blocks[-1]) + 1) * block_m]
            c = int(counts[e])
            assert torch.equal(seg[:c], (flat == e).nonzero().flatten())
            assert torch.all(seg[c:] == n)


@pytest.mark.parametrize("T,E,K,block_m", [(1, 8, 1, 16), (5, 8, 2, 16), (33, 16, 4, 16), (33, 8, 4, 4),
                                           (7, 4, 4, 1), (0, 8, 2, 16)])
def test_moe_align_invariants(T, E, K, block_m):
    g = torch.Generator().manual_seed(T * 31 + E)
    logits = torch.randn(T, E, generator=g)
    logits[:, min(EMPTY_EXPERT, E - 1)] = float("-inf")
    topk_ids = torch.topk(logits, K, dim=-1).indices.to(DEVICE)
    _check_align(topk_ids, E, block_m)
    _check_align(topk_ids.int(), E, block_m)


def test_moe_align_all_one_expert():
    _check_align(torch.full((9, 1), 2, dtype=torch.int64, device=DEVICE), 4, 4)      # one expert, the rest empty


# ----------------------------------------------------------------------------------------
# The kernel against fused_moe_ref
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,E,K,dtype",
                         pairwise([1, 5, 33], [8, 16], [1, 2, 4], [torch.float32, torch.bfloat16]))
def test_matches_ref(T, E, K, dtype):
    """Every pair of token count, expert count, top-k and dtype."""
    _check(_case(T, E, K, 64, 32, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_tails_swizzle_strided(dtype):
    """N and K tails in both GEMMs (H = 80, I = 48 with 32-wide tiles), group_m > 1 (swizzled
    blocks), block_m 32, a strided hidden and int32 ids."""
    config = FusedMoEConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)
    _check(_case(21, 8, 2, 80, 48, dtype, strided=True, ids_dtype=torch.int32), config)


def test_zero_tokens():
    hidden, w13, w2, w, ids = _case(0, 8, 2, 64, 32, torch.float32)
    out = fused_moe_triton(hidden, w13, w2, w, ids)
    assert out.shape == (0, 64) and out.dtype == torch.float32


def test_config_checks():
    for kwargs, field in [(dict(block_m=8), "block_m"), (dict(block_n=24), "block_n"), (dict(block_k=512), "block_k"),
                          (dict(num_warps=3), "num_warps"), (dict(group_m=0), "group_m"),
                          (dict(num_stages=0), "num_stages")]:
        with pytest.raises(ValueError, match=field):
            FusedMoEConfig(**kwargs)
    assert fused_moe_config(1, 8, 64, 32, 2, torch.device("cpu")).block_m == 16
    assert fused_moe_config(4, 64, 2048, 1408, 4).block_m == 16                    # decode: <= E tokens
    assert fused_moe_config(512, 64, 2048, 1408, 4) == FusedMoEConfig(64, 64, 32, 8, 4, 3)


def test_checks_reject_bad_inputs():
    hidden, w13, w2, w, ids = _case(3, 8, 2, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="hidden: dtype"):
        fused_moe_triton(hidden.long(), w13, w2, w, ids)
    with pytest.raises(ValueError, match="hidden: last dim"):
        fused_moe_triton(torch.randn(64, 3, device=DEVICE).t(), w13, w2, w, ids)
    with pytest.raises(ValueError, match="w13: dtype"):
        fused_moe_triton(hidden, w13.to(torch.bfloat16), w2, w, ids)
    with pytest.raises(ValueError, match="w13: expected shape"):
        fused_moe_triton(hidden, w13[:, :, :32].contiguous(), w2, w, ids)
    with pytest.raises(ValueError, match="w13: expected shape"):
        fused_moe_triton(hidden, w13[:, :63].contiguous(), w2, w, ids)
    with pytest.raises(ValueError, match="w13: must be contiguous"):
        fused_moe_triton(hidden, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, w, ids)
    with pytest.raises(ValueError, match="w2: expected shape"):
        fused_moe_triton(hidden, w13, w2[:, :, :16].contiguous(), w, ids)
    with pytest.raises(ValueError, match="topk_ids: dtype"):
        fused_moe_triton(hidden, w13, w2, w, ids.float())
    with pytest.raises(ValueError, match="topk_ids: expected shape"):
        fused_moe_triton(hidden, w13, w2, w[:2], ids[:2])
    with pytest.raises(ValueError, match="topk_weights: expected shape"):
        fused_moe_triton(hidden, w13, w2, w[:, :1], ids)
    with pytest.raises(ValueError, match="config"):
        fused_moe_triton(hidden, w13, w2, w, ids, config=dict(block_m=16))
    with pytest.raises(ValueError, match="block_m"):
        moe_align(ids, 8, 0)


# ----------------------------------------------------------------------------------------
# FP8 (e4m3) expert weights, widened in registers (W8A16)
# ----------------------------------------------------------------------------------------
def test_dequantize_fp8_experts():
    """The twin's weights: ``kernels.fp8_linear.dequantize_fp8_weight`` per expert, ragged edge blocks too."""
    w = torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(0))
    for block in (None, (16, 16), (24, 32)):
        q, s = quantize_experts_fp8(w, block)
        deq = dequantize_fp8_experts(q, s, block, torch.float32)
        assert deq.shape == (3, 40, 24) and deq.dtype == torch.float32
        # e4m3 rounds normals to 3 mantissa bits (relative 2^-4) and subnormals to steps of 2^-9 of the
        # scale (absolute 2^-10 * scale)
        torch.testing.assert_close(deq.cpu(), w, rtol=2.0 ** -4, atol=float(s.max()) * 2.0 ** -10)
        e, n, k = 2, 39, 23
        sc = s[e, n] if block is None else s[e, n // block[0], k // block[1]]
        assert float(deq[e, n, k]) == float(q[e, n, k].float() * sc)
    assert dequantize_fp8_experts(q, s, (24, 32), torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("block,dtype,T,H,inter", [
    (None, torch.bfloat16, 5, 64, 32),
    (None, torch.float32, 9, 64, 32),
    ((16, 32), torch.bfloat16, 5, 64, 32),
    ((16, 32), torch.float32, 1, 64, 32),
    ((24, 32), torch.bfloat16, 7, 80, 40),        # ragged: 2I, H, I not multiples; a block across gate|up
    ((24, 32), torch.float32, 7, 80, 40),
], ids=["ch-bf16", "ch-f32", "blk-bf16", "blk-f32-T1", "ragged-bf16", "ragged-f32"])
def test_fp8_matches_ref(block, dtype, T, H, inter):
    """FP8 weights, per channel and per block, against the twin on the dequantized weights."""
    args, scales = fp8_case(T, 8, 2, H, inter, dtype, block)
    check_fp8(args, scales)


def test_fp8_block_k_clamped_tails_swizzle():
    """Config block_k 64 with BK 16 (the K tile clamped to 16), N and K tails, group_m 2, block_m 32."""
    config = FusedMoEConfig(block_m=32, block_n=32, block_k=64, group_m=2, num_warps=4, num_stages=1)
    args, scales = fp8_case(9, 4, 2, 48, 40, torch.bfloat16, (32, 16), strided=True, ids_dtype=torch.int32)
    check_fp8(args, scales, config)


def fp8_bad_scales(scales: dict) -> list[tuple[dict, str]]:
    """(changes to ``fp8_case``'s (16, 32)-block FP8 keywords (H 64, I 32), the ValueError they raise)."""
    s13, s2 = scales["w13_scale"], scales["w2_scale"]
    return [(dict(w13_scale=s13[:, :-1].contiguous()), "w13_scale: expected shape"),
            (dict(w2_scale=s2[:, :-1].contiguous()), "w2_scale: expected shape"),
            (dict(scale_block=(32, 32)), "w13_scale: expected shape"),
            (dict(scale_block=None), "w13_scale: expected shape"),              # block scales as per channel
            (dict(w2_scale=None, scale_block=None), "w2_scale: required"),
            (dict(w13_scale=None), "w13_scale: required"),
            (dict(w13_scale=s13.double()), "w13_scale: dtype"),
            (dict(w13_scale=s13.mT.contiguous().mT), "w13_scale: must be contiguous"),
            (dict(scale_block=(0, 32)), "scale_block: expected"),
            (dict(scale_block=(16, 24)), "scale_block: BK"),
            (dict(scale_block=16), "scale_block: expected")]


def test_fp8_checks_reject_bad_inputs():
    args, scales = fp8_case(3, 8, 2, 64, 32, torch.float32, (16, 32))
    hidden, w13, w2, w, ids = args
    for change, match in fp8_bad_scales(scales):
        with pytest.raises(ValueError, match=match):
            fused_moe_triton(hidden, w13, w2, w, ids, **{**scales, **change})
    with pytest.raises(ValueError, match="scale_block: .* without"):
        fused_moe_triton(hidden, w13.float(), w2.float(), w, ids, scale_block=(16, 32))
    with pytest.raises(ValueError, match="w13: dtype"):                            # scales with float weights
        fused_moe_triton(hidden, w13.float(), w2, w, ids, **scales)
    with pytest.raises(ValueError, match="w2: dtype"):
        fused_moe_triton(hidden, w13, w2.float(), w, ids, **scales)
    with pytest.raises(ValueError, match="w13: dtype"):                            # fp8 weights, no scales
        fused_moe_triton(hidden, w13, w2, w, ids)


# ----------------------------------------------------------------------------------------
# CUDA: MoE-model sizes (Qwen1.5-MoE-A2.7B: E 60, K 4, H 2048, I 1408; Mixtral-like E 8, K 2)
# ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 7, 256])
@pytest.mark.parametrize("E,K,H,I", [(60, 4, 2048, 1408), (8, 2, 1024, 3584)])
def test_gpu_real_sizes(T, E, K, H, I):
    _check(_case(T, E, K, H, I, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graph_capture():
    """No host read: the call captures in a CUDA graph and replays with new routing."""
    hidden, w13, w2, w, ids = _case(16, 60, 4, 2048, 1408, torch.bfloat16)
    fused_moe_triton(hidden, w13, w2, w, ids)                                      # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(hidden, w13, w2, w, ids)
    _, _, _, w_new, ids_new = _case(16, 60, 4, 2048, 1408, torch.bfloat16, seed=5)
    w.copy_(w_new)
    ids.copy_(ids_new)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), fused_moe_ref(hidden, w13, w2, w, ids).float(), rtol=3e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 7, 256])
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["channel", "block128"])
def test_gpu_fp8_real_sizes(T, block):
    """Qwen3-30B-A3B-FP8 layer sizes (E 128, K 8, H 2048, I 768), 128 x 128 block scales as it ships."""
    check_fp8(*fp8_case(T, 128, 8, 2048, 768, torch.bfloat16, block))


# ----------------------------------------------------------------------------------------
# Compiled for Hopper on any machine (the interpreter does not type-check what the compiler does)
# ----------------------------------------------------------------------------------------
_COMPILE_SCRIPT = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile
from kernels.fused_moe import _grouped_gemm_kernel as fn

for scale, silu_mul in ((0, True), (1, True), (1, False), (2, True), (2, False)):
    w_type = "*fp8e4nv" if scale else "*bf16"
    ints = ("N", "K", "num_pairs", "num_experts", "stride_a", "stride_we", "stride_se", "num_scale_kb",
            "stride_out")
    signature = dict(a_ptr="*bf16", w_ptr=w_type, ws_ptr="*fp32" if scale else w_type, out_ptr="*bf16",
                     sorted_pair_ptr="*i64", expert_of_block_ptr="*i64", num_valid_ptr="*i64",
                     topk_w_ptr="*fp32", **{k: "i32" for k in ints})
    consts = dict(TOP_K=8, GATHER=silu_mul, SILU_MUL=silu_mul, SCATTER=not silu_mul, MUL_WEIGHT=not silu_mul,
                  LORA=False, ADD_OUT=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, UPCAST=False,
                  DOT_PRECISION="tf32", SCALE=scale, SCALE_BN=128 if scale == 2 else 1,
                  SCALE_BK=128 if scale == 2 else 1)
    signature = {**signature, **{k: "constexpr" for k in consts}}
    source = ASTSource(fn=fn, signature={k: signature[k] for k in fn.arg_names}, constexprs=consts)
    options = dict(num_warps=4, num_stages=3)
    assert triton_compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]
    print("compiled", scale, silu_mul)
"""


def test_kernel_compiles_for_sm90(tmp_path):
    """The grouped GEMM, float and FP8 weights (per channel, 128 x 128 blocks; both stages), compiles to sm_90
    cubins through Triton's bundled ptxas with no GPU (in a process without TRITON_INTERPRET)."""
    from tests.kernels.compile_sm90 import run_compile_script

    assert run_compile_script(_COMPILE_SCRIPT, tmp_path).count("compiled") == 5
