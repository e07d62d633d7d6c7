"""FP8 decode steps through ``kernels.gemv`` (W8A16: the e4m3 weight read with its scales, the norm /
SiLU-and-mul prologues fused as for bf16 layers).

On CUDA, decode steps of at most ``KernelPolicy.decode_gemv_max_tokens`` rows take the GEMV; CPU keeps
only the dequantized weight and never does. Here the path is forced on for CPU tensors (as
tests/models/test_fused_decode.py does for float weights), the kernels running through the Triton
interpreter on the e4m3 weights and scales the CUDA path reads: the engine must give the unfused FP8
engine's tokens and logprobs (per-channel ``--quantization fp8`` and a block-wise HF ``fp8`` checkpoint),
and every decode projection must have run as an FP8 GEMV.
"""

from __future__ import annotations

import pytest
import torch

import kernels.gemv as gemv_kernels
from engine import LLM, SamplingParams
from engine.kernel_policy import KernelPolicy
from engine.layers.fp8 import Fp8Weight
from engine.layers.linear import Linear
from tests.models.utils import check_logprobs_close, ours_as_ref

MAX_TOKENS = 4
PROMPTS = ["The quick brown fox", "Hello world, this is"]


def force_fp8_gemv_on_cpu(monkeypatch, max_tokens: int = 2) -> dict[str, list]:
    """CPU ``Fp8Weight``s keep their e4m3 weight and accept the GEMV; ``Linear.uses_decode_gemv`` is the
    CUDA rule without ``x.is_cuda`` (FP8 projections only). Returns each GEMV wrapper's calls (the
    ``scale_block`` of each call, or "float" for a float weight)."""
    init = Fp8Weight.__init__

    def keep_e4m3(self, weight, scale, block, input_scale, dtype):
        init(self, weight, scale, block, input_scale, dtype)
        self.weight, self.decode_gemv = weight, True
    monkeypatch.setattr(Fp8Weight, "__init__", keep_e4m3)

    def use(linear, x, policy):
        return (0 < x.shape[0] <= max_tokens and (linear.adapter is None or linear.adapter.adds_nothing())
                and policy.fp8_decode_gemv and isinstance(linear.weight_q, Fp8Weight) and linear.weight_q.decode_gemv)
    monkeypatch.setattr(Linear, "uses_decode_gemv", use)
    calls = {"gemv": [], "silu_mul_gemv": [], "add_rms_norm_gemv": []}
    for name in calls:
        fn = getattr(gemv_kernels, name)

        def counted(*a, _fn=fn, _name=name, **kw):
            calls[_name].append(kw["scale_block"] if kw.get("weight_scale") is not None else "float")
            return _fn(*a, **kw)
        monkeypatch.setattr(gemv_kernels, name, counted)
    return calls


@pytest.fixture(scope="module")
def fp8_block_dir(tmp_path_factory):
    from tests.quantization.formats import build_fp8_block

    path, _ = build_fp8_block(tmp_path_factory.mktemp("fp8-block"), scale_dtype=torch.float32)
    return path


@pytest.mark.parametrize("case", ["online", "block"])
def test_fp8_decode_steps_take_the_gemv(case, tiny_llama_dir, fp8_block_dir, monkeypatch):
    if case == "online":
        kw = dict(model=str(tiny_llama_dir), quantization="fp8")
    else:
        kw = dict(model=str(fp8_block_dir))
    kw |= dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=2, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    ref = LLM(**kw).generate(PROMPTS, params, use_tqdm=False)
    calls = force_fp8_gemv_on_cpu(monkeypatch)
    llm = LLM(**kw)
    linears = [m for m in llm.llm_engine.core.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.weight_q, Fp8Weight) and m.weight_q.weight is not None for m in linears)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for i, (o, r) in enumerate(zip(outs, ref)):
        check_logprobs_close(ours_as_ref(r.outputs[0]), ours_as_ref(o.outputs[0]), name=f"prompt {i}")
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
    # Every decode step (2 rows), every layer: norm -> qkv, o_proj, norm -> gate_up, SiLU-and-mul -> down,
    # each an FP8 GEMV with the checkpoint's scales; prefill steps took none.
    layers, decode_steps = 2, MAX_TOKENS - 1
    block = None if case == "online" else (128, 128)
    assert calls["add_rms_norm_gemv"] == [block] * (2 * layers * decode_steps)
    assert calls["silu_mul_gemv"] == calls["gemv"] == [block] * (layers * decode_steps)


def test_gemv_on_every_projection_whose_scale_blocks_it_takes():
    """``decode_gemv_applies``: with the e4m3-dot maths every Llama-3-8B projection reads through the GEMV
    (qkv and gate_up too, where the widening lost to the W8A8 GEMM); 8-input scale blocks never."""
    from engine.layers.fp8 import decode_gemv_applies

    assert decode_gemv_applies(4096, 4096, None) and decode_gemv_applies(4096, 14336, (128, 128))
    assert decode_gemv_applies(6144, 4096, None) and decode_gemv_applies(28672, 4096, (128, 128))
    assert not decode_gemv_applies(4096, 14336, (128, 8))


def test_fp8_decode_gemv_policy_switch():
    assert KernelPolicy().fp8_decode_gemv
    assert not KernelPolicy().with_overrides("fp8_decode_gemv=0").fp8_decode_gemv


def test_cpu_never_takes_the_gemv():
    """The real rule on CPU: never (the CPU Fp8Weight keeps only its dequantized weight)."""
    lin = Linear(64, [32])
    lin.quantize_fp8()
    assert isinstance(lin.weight_q, Fp8Weight) and not lin.weight_q.decode_gemv and lin.weight_q.weight is None
    assert not lin.uses_decode_gemv(torch.zeros(1, 64), KernelPolicy())
    float_lin = Linear(64, [32])
    assert float_lin.decode_gemv_weight() == (float_lin.weight, None, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block", [None, (128, 128), (128, 8)], ids=["channel", "block", "block8"])
def test_gpu_fp8_linear_takes_the_gemv(block, monkeypatch):
    """The real rule on CUDA: FP8 projections of <= decode_gemv_max_tokens rows run the GEMV on their
    e4m3 weight (not with 8-input scale blocks, nor with more rows), equal to the dequantized product of the
    rows rounded to e4m3 per token (the default maths, ``gemv_ref``'s E4M3_DOT); the unrounded product only
    within that rounding (e4m3's 3 mantissa bits: ~1.8% per input, ~0.02 typical on these unit-size sums)."""
    from kernels.fp8_linear import dequantize_fp8_weight

    torch.manual_seed(0)
    n, k = 512, 1024
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    scale_shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    scale = (0.5 + torch.rand(scale_shape, device="cuda")) / 448
    full = scale[:, None] if block is None else scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    wq = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    lin = Linear(k, [n]).to(device="cuda", dtype=torch.bfloat16)
    lin.weight_q, lin.weight = Fp8Weight(wq, scale, block, None, torch.bfloat16), None
    seen = []

    def spy(*a, **kw):
        seen.append(kw["scale_block"])
        return gemv(*a, **kw)
    gemv = gemv_kernels.gemv
    monkeypatch.setattr(gemv_kernels, "gemv", spy)
    policy = KernelPolicy()
    for rows in (1, 2, 3):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        takes = block != (128, 8) and rows <= policy.decode_gemv_max_tokens
        assert lin.uses_decode_gemv(x, policy) == takes
        assert not lin.uses_decode_gemv(x, KernelPolicy(fp8_decode_gemv=False))
        if takes:
            out = lin(x).float()
            twin = gemv_kernels.gemv_ref(x, wq, weight_scale=scale, scale_block=block,
                                         fp8_math=gemv_kernels.E4M3_DOT)
            torch.testing.assert_close(out, twin.float(), rtol=2e-2, atol=2e-2)
            exact = (x.float() @ dequantize_fp8_weight(wq, scale, block).T)                # rows unrounded
            assert (out - exact).abs().mean() < 0.04 and (out - exact).abs().max() < 0.2
    assert seen == [block] * (0 if block == (128, 8) else policy.decode_gemv_max_tokens)
