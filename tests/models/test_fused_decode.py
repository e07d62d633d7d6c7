"""The fused decode path (``engine.layers.fused`` -> ``kernels.gemv``) inside the model, on CPU.

On CUDA, steps of a few tokens run norm -> qkv, SiLU-and-mul -> down and o_proj as GEMV kernels.
Here the path is forced on for CPU tensors (the kernels run through the Triton interpreter) and
the engine must give the unfused engine's tokens and logprobs, on Llama and on Qwen2 (q/k/v
biases); the fused kernels must actually have run.
"""

from __future__ import annotations

import pytest

import engine.layers.fused as fused
import kernels.gemv as gemv_kernels
from engine import LLM, SamplingParams
from tests.models.utils import check_logprobs_close, ours_as_ref

MAX_TOKENS = 6


def force_fused_on_cpu(monkeypatch, max_tokens: int = 2) -> dict[str, int]:
    """Take the fused path for CPU steps of <= ``max_tokens`` tokens; count the kernels' calls."""
    calls = {"gemv": 0, "silu_mul_gemv": 0, "add_rms_norm_gemv": 0}

    def use(linear, x):
        return 0 < x.shape[0] <= max_tokens and (linear.lora is None or linear.lora.adds_nothing())

    monkeypatch.setattr(fused, "use_decode_gemv", use)
    for name in calls:
        fn = getattr(gemv_kernels, name)

        def counted(*a, _fn=fn, _name=name, **kw):
            calls[_name] += 1
            return _fn(*a, **kw)
        monkeypatch.setattr(gemv_kernels, name, counted)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_decode_matches_unfused(arch, tiny_llama_dir, tiny_qwen2_dir, tiny_prompts, monkeypatch):
    model_dir = str(tiny_llama_dir if arch == "llama" else tiny_qwen2_dir)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    prompts = tiny_prompts[:2]
    kw = dict(max_num_seqs=2, enable_prefix_caching=False)
    ref = LLM(model_dir, **kw).generate(prompts, params, use_tqdm=False)
    calls = force_fused_on_cpu(monkeypatch)
    outs = LLM(model_dir, **kw).generate(prompts, params, use_tqdm=False)
    for i, (o, r) in enumerate(zip(outs, ref)):
        check_logprobs_close(ours_as_ref(r.outputs[0]), ours_as_ref(o.outputs[0]), name=f"prompt {i}")
    # Decode steps (2 tokens) took the fused path; prefill steps did not.
    assert calls["add_rms_norm_gemv"] > 0 and calls["silu_mul_gemv"] > 0 and calls["gemv"] > 0
    assert calls["add_rms_norm_gemv"] == 2 * calls["silu_mul_gemv"] == 2 * calls["gemv"]
