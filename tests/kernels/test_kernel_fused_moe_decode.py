"""Fused MoE decode path (``kernels.fused_moe_decode``): the two GEMV-style launches against the torch twin
``engine.layers.moe.fused_moe_ref`` and against the sorted path (``kernels.fused_moe``), and the engine's choice
between the two (``engine.layers.moe.uses_moe_decode``). CPU tensors run through the interpreter with tiny shapes
(odd widths: N and K tails in both launches; both inner-product forms); the CUDA tests run Qwen3-30B-A3B and
Mixtral layer sizes, a CUDA-graph capture and a MoE block with a shared expert."""

from __future__ import annotations

import pytest
import torch

from engine.kernel_policy import KernelPolicy
from engine.layers.moe import SparseMoeBlock, fused_moe_ref, uses_moe_decode
from kernels.fused_moe import fused_moe_triton
from kernels.fused_moe_decode import (MoEDecodeConfig, MoEDecodeLaunch, fused_moe_decode_triton,
                                      moe_decode_config)
from tests.kernels.test_kernel_fused_moe import DEVICE, _case, _tol, check_fp8, fp8_bad_scales, fp8_case
from tests.kernels.test_kernel_fused_moe import _check as check_fused_moe
from tests.kernels.pairwise import pairwise

ROUTINGS = [(8, 2), (64, 8)]
"""(experts, top_k) of the tests: Mixtral-like and Qwen3-MoE-like."""


def _inputs(T: int, E: int, K: int, H: int, I: int, dtype, renormalize: bool, seed: int = 0, **kwargs):
    """``test_kernel_fused_moe._case``'s (hidden, w13, w2, topk_weights, topk_ids): one expert never routed to,
    and with 8 experts tokens share experts."""
    return _case(T, E, K, H, I, dtype, seed, renormalize=renormalize, **kwargs)


def _check(args, config=None):
    return check_fused_moe(args, config, fn=fused_moe_decode_triton)


def _config(use_dot: int) -> MoEDecodeConfig:
    """Interpreter tiles: 16 columns, 32 inputs per step (tails at H 67 and I 37), one form for both launches."""
    launch = MoEDecodeLaunch(block_n=16, block_k=32, num_warps=4, num_stages=1, use_dot=use_dot)
    return MoEDecodeConfig(gate_up=launch, down=launch)


# ----------------------------------------------------------------------------------------
# The kernel against fused_moe_ref (interpreter on CPU)
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,routing,dtype,renormalize",
                         pairwise([1, 4], ROUTINGS, [torch.float32, torch.bfloat16], [True, False]))
def test_matches_ref(T, routing, dtype, renormalize):
    """Odd H and I (67, 37: tails of the 64-wide tiles), default interpreter tiles (elementwise form); every
    pair of token count, routing, dtype and renormalization."""
    E, K = routing
    _check(_inputs(T, E, K, 67, 37, dtype, renormalize))


def test_policy_bound():
    """8 tokens top-8 of 64 experts: the 64 pairs of ``KernelPolicy.moe_decode_max_pairs`` (routing weights
    as they come: renormalization is the router's, covered by ``test_matches_ref``)."""
    _check(_inputs(8, 64, 8, 67, 37, torch.float32, False))


@pytest.mark.parametrize("T", [1, 2, 3, 8])
def test_token_counts(T):
    """1, 2, 3 and 8 tokens (the policy's most) with 8 experts top-2 (tokens share experts from T = 2 on),
    the tl.dot form."""
    _check(_inputs(T, 8, 2, 48, 40, torch.float32, True), _config(use_dot=1))


@pytest.mark.parametrize("dtype,use_dot", [(torch.float32, 1), (torch.bfloat16, 0)],
                         ids=["f32-dot", "bf16-ew"])
def test_forms_strided_int32(dtype, use_dot):
    """Both inner-product forms, a strided hidden and int32 ids; equal to the sorted path within rounding."""
    args = _inputs(5, 8, 2, 67, 37, dtype, False, strided=True, ids_dtype=torch.int32)
    out = _check(args, _config(use_dot))
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out.float(), fused_moe_triton(*args).float(), rtol=rtol, atol=atol)


def test_float32_is_exact_to_accumulation_order():
    """float32 routing weights of one expert per token (K = 1, weight 1): the output is that expert's MLP."""
    hidden, w13, w2, _, _ = _inputs(2, 8, 2, 32, 16, torch.float32, True)
    ids = torch.tensor([[5], [2]], device=DEVICE)
    weights = torch.ones(2, 1, device=DEVICE)
    out = fused_moe_decode_triton(hidden, w13, w2, weights, ids)
    for t, e in enumerate((5, 2)):
        gate, up = (hidden[t] @ w13[e].T).split(16)
        expected = (torch.nn.functional.silu(gate) * up) @ w2[e].T
        torch.testing.assert_close(out[t], expected, rtol=1e-5, atol=1e-5)


def test_zero_tokens():
    hidden, w13, w2, w, ids = _inputs(0, 8, 2, 64, 32, torch.float32, True)
    out = fused_moe_decode_triton(hidden, w13, w2, w, ids)
    assert out.shape == (0, 64) and out.dtype == torch.float32


def test_config_checks():
    for kwargs, name in [(dict(block_n=24), "block_n"), (dict(block_n=8, use_dot=1), "block_n"),
                         (dict(block_k=8), "block_k"), (dict(num_warps=3), "num_warps"),
                         (dict(num_stages=0), "num_stages"), (dict(use_dot=2), "use_dot")]:
        with pytest.raises(ValueError, match=name):
            MoEDecodeLaunch(**kwargs)
    assert MoEDecodeLaunch(block_n=8, use_dot=0).block_n == 8                       # below 16 without tl.dot
    with pytest.raises(ValueError, match="gate_up"):
        MoEDecodeConfig(gate_up=dict(block_n=16))
    assert moe_decode_config(1, 64, 32, 2, torch.device("cpu")).gate_up.use_dot == 0
    assert moe_decode_config(1, 2048, 768, 8).down.block_n == 16


def test_checks_reject_bad_inputs():
    hidden, w13, w2, w, ids = _inputs(3, 8, 2, 64, 32, torch.float32, True)
    with pytest.raises(ValueError, match="hidden: dtype"):
        fused_moe_decode_triton(hidden.long(), w13, w2, w, ids)
    with pytest.raises(ValueError, match="w13: expected shape"):
        fused_moe_decode_triton(hidden, w13[:, :63].contiguous(), w2, w, ids)
    with pytest.raises(ValueError, match="w2: expected shape"):
        fused_moe_decode_triton(hidden, w13, w2[:, :, :16].contiguous(), w, ids)
    with pytest.raises(ValueError, match="topk_weights: expected shape"):
        fused_moe_decode_triton(hidden, w13, w2, w[:, :1], ids)
    with pytest.raises(ValueError, match="config"):
        fused_moe_decode_triton(hidden, w13, w2, w, ids, config=_config(0).gate_up)


# ----------------------------------------------------------------------------------------
# FP8 (e4m3) expert weights, widened in registers (W8A16)
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("block,dtype,use_dot", [
    (None, torch.bfloat16, 0), (None, torch.float32, 1),
    ((16, 32), torch.bfloat16, 1), ((16, 32), torch.float32, 0),
    ((24, 32), torch.bfloat16, 0), ((24, 32), torch.float32, 1),
], ids=["ch-bf16-ew", "ch-f32-dot", "blk-bf16-dot", "blk-f32-ew", "ragged-bf16-ew", "ragged-f32-dot"])
def test_fp8_matches_ref(block, dtype, use_dot):
    """FP8 weights per channel and per block, both inner-product forms, against the twin on the dequantized
    weights; H 67 and I 37 (tails of the 16 x 32 tiles; ragged scale blocks in both launches)."""
    args, scales = fp8_case(5, 8, 2, 67, 37, dtype, block)
    check_fp8(args, scales, _config(use_dot), fn=fused_moe_decode_triton)


@pytest.mark.parametrize("block,dtype,use_dot", [
    ((32, 32), torch.bfloat16, 1), ((32, 16), torch.float32, 0), ((64, 16), torch.bfloat16, 0),
], ids=["bk-tile-bf16-dot", "two-blocks-per-chunk-f32-ew", "two-blocks-per-chunk-bf16-ew"])
def test_fp8_block_scales_on_the_input_side(block, dtype, use_dot):
    """Block scales whose row blocks hold whole programs (block_n 16 divides BN, BN divides I = 64) go on the
    input chunk (SCALE 3), with chunks of 32 inputs that may span two 16-input scale blocks; H 80 (a ragged
    last scale column block)."""
    from kernels.fused_moe_decode import SCALE_BLOCK_INPUT, _block_form
    from kernels.fused_moe import SCALE_BLOCK

    config = _config(use_dot)
    assert _block_form(SCALE_BLOCK, config.gate_up, block, rows_offset=64) == (SCALE_BLOCK_INPUT, 32)
    assert _block_form(SCALE_BLOCK, config.down, block, rows_offset=0) == (SCALE_BLOCK_INPUT, 32)
    args, scales = fp8_case(5, 8, 2, 80, 64, dtype, block)
    check_fp8(args, scales, config, fn=fused_moe_decode_triton)


@pytest.mark.parametrize("block", [None, (32, 32)], ids=["channel", "block"])
def test_fp8_default_config_and_sorted_path(block):
    """Interpreter default tiles (64 wide, block_k clamped to BK 32), 1 token top-8 of 64 experts; equal to
    the sorted path on the same FP8 weights within rounding."""
    args, scales = fp8_case(1, 64, 8, 64, 48, torch.bfloat16, block)
    out = check_fp8(args, scales, fn=fused_moe_decode_triton)
    rtol, atol = _tol(torch.bfloat16)
    torch.testing.assert_close(out.float(), fused_moe_triton(*args, **scales).float(), rtol=rtol, atol=atol)


def test_fp8_checks_reject_bad_inputs():
    args, scales = fp8_case(3, 8, 2, 64, 32, torch.float32, (16, 32))
    for change, match in fp8_bad_scales(scales):
        with pytest.raises(ValueError, match=match):
            fused_moe_decode_triton(*args, **{**scales, **change})
    with pytest.raises(ValueError, match="w13: dtype"):                            # fp8 weights, no scales
        fused_moe_decode_triton(*args)


# ----------------------------------------------------------------------------------------
# The engine's choice
# ----------------------------------------------------------------------------------------
def test_engine_choice_follows_the_policy():
    policy = KernelPolicy()
    assert [uses_moe_decode(n, policy) for n in (0, 1, 8, 64, 65, 512)] == [False, True, True, True, False, False]
    assert not uses_moe_decode(8, KernelPolicy(moe_decode_max_pairs=0))
    assert KernelPolicy().with_overrides("moe_decode_max_pairs=16").moe_decode_max_pairs == 16
    with pytest.raises(ValueError, match="0-4096"):
        KernelPolicy(moe_decode_max_pairs=5000)


# ----------------------------------------------------------------------------------------
# CUDA: Qwen3-30B-A3B (E 128, K 8, H 2048, I 768) and Mixtral-like (E 8, K 2) layer sizes
# ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 4, 8, 16])
@pytest.mark.parametrize("E,K,H,I", [(128, 8, 2048, 768), (8, 2, 1024, 3584)])
def test_gpu_real_sizes(T, E, K, H, I):
    args = _inputs(T, E, K, H, I, torch.bfloat16, True)
    out = _check(args)
    torch.testing.assert_close(out.float(), fused_moe_triton(*args).float(), rtol=3e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["channel", "block128"])
def test_gpu_fp8_real_sizes(T, block):
    """Qwen3-30B-A3B-FP8 layer sizes, 128 x 128 block scales as it ships; equal to the sorted path."""
    args, scales = fp8_case(T, 128, 8, 2048, 768, torch.bfloat16, block)
    out = check_fp8(args, scales, fn=fused_moe_decode_triton)
    torch.testing.assert_close(out.float(), fused_moe_triton(*args, **scales).float(), rtol=3e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graph_capture():
    """No host read: the call captures in a CUDA graph and replays with new routing."""
    hidden, w13, w2, w, ids = _inputs(4, 128, 8, 2048, 768, torch.bfloat16, True)
    fused_moe_decode_triton(hidden, w13, w2, w, ids)                                # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_decode_triton(hidden, w13, w2, w, ids)
    _, _, _, w_new, ids_new = _inputs(4, 128, 8, 2048, 768, torch.bfloat16, True, seed=5)
    w.copy_(w_new)
    ids.copy_(ids_new)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), fused_moe_ref(hidden, w13, w2, w, ids).float(), rtol=3e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 64])
def test_gpu_block_with_shared_expert(T, monkeypatch):
    """A Qwen2-MoE-style block (shared expert beside the routed ones) on both sides of the switch (T 1: the
    decode path, T 64: the sorted path) equals its CPU float32 self run through the reference."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)         # float32 GEMMs on both sides
    torch.manual_seed(0)
    block = SparseMoeBlock(256, 64, 8, 128, True, shared_expert_intermediate_size=192)
    for p in block.parameters():
        p.data.normal_(0, 0.05)
    x = torch.randn(T, 256)
    ref = block(x)
    assert uses_moe_decode(T * 8, KernelPolicy()) == (T == 1)
    out = block.to(DEVICE)(x.to(DEVICE))
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_layer_takes_the_policy_path(monkeypatch):
    """``engine.layers.moe.fused_moe`` runs the decode kernel for 8 pairs under the default policy and the sorted
    one with ``moe_decode_max_pairs=0``."""
    import kernels.fused_moe_decode as decode_module
    from engine.forward_context import forward_context
    from engine.layers.moe import fused_moe

    calls = []
    real = decode_module.fused_moe_decode_triton

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(decode_module, "fused_moe_decode_triton", spy)
    args = _inputs(1, 128, 8, 2048, 768, torch.bfloat16, True)
    with forward_context(None, KernelPolicy()):
        decode_out = fused_moe(*args)
    assert len(calls) == 1
    with forward_context(None, KernelPolicy(moe_decode_max_pairs=0)):
        sorted_out = fused_moe(*args)
    assert len(calls) == 1
    torch.testing.assert_close(decode_out.float(), sorted_out.float(), rtol=3e-2, atol=5e-2)


# ----------------------------------------------------------------------------------------
# Compiled for Hopper on any machine (the interpreter does not type-check what the compiler does)
# ----------------------------------------------------------------------------------------
_COMPILE_SCRIPT = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile
from kernels.fused_moe_decode import _down_kernel, _gate_up_kernel

for use_dot, scale in ((0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)):
    w_type = "*fp8e4nv" if scale else "*bf16"
    common = dict(BLOCK_N=16 if use_dot else 8, BLOCK_K=128, USE_DOT=bool(use_dot), UPCAST=False,
                  DOT_PRECISION="tf32", SCALE=scale, SCALE_BN=128 if scale >= 2 else 1,
                  SCALE_BK=128 if scale >= 2 else 1)
    scales = dict(ws_ptr="*fp32" if scale else w_type, stride_se="i32", num_scale_kb="i32")
    cases = [(_gate_up_kernel, dict(x_ptr="*bf16", w13_ptr=w_type, ids_ptr="*i64", act_ptr="*bf16", H="i32",
                                    I="i32", stride_x="i32", stride_we="i32", **scales), dict(TOP_K=8)),
             (_down_kernel, dict(act_ptr="*bf16", w2_ptr=w_type, ids_ptr="*i64", topk_w_ptr="*fp32",
                                 out_ptr="*bf16", H="i32", I="i32", stride_we="i32", **scales),
              dict(TOP_K=8, TOP_K_P2=8))]
    for fn, signature, consts in cases:
        consts = {**consts, **common}
        params = fn.arg_names
        signature = {**signature, **{k: "constexpr" for k in consts}}
        signature = {k: signature[k] for k in params}
        source = ASTSource(fn=fn, signature=signature, constexprs=consts)
        compiled = triton_compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
        assert compiled.asm["cubin"], fn
        print("compiled", fn.__name__, use_dot, scale)
"""


def test_kernels_compile_for_sm90(tmp_path):
    """Both launches, both inner-product forms, float and FP8 weights (per channel, 128 x 128 blocks),
    compile to sm_90 (H100/H200) cubins through Triton's bundled ptxas with no GPU (in a process without
    TRITON_INTERPRET: the interpreter does not type-check what the compiler does, e.g. a jit function's
    returns of two types in a constexpr branch)."""
    from tests.kernels.compile_sm90 import run_compile_script

    assert run_compile_script(_COMPILE_SCRIPT, tmp_path).count("compiled") == 16
