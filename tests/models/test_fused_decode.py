"""The fused decode path (``engine.layers.fused`` / ``Linear.forward_base`` -> ``kernels.gemv``)
inside the model, on CPU.

On CUDA, steps of a few tokens run norm -> qkv, SiLU-and-mul -> down and o_proj as GEMV kernels.
Here the path is forced on for CPU tensors (the kernels run through the Triton interpreter) and
the engine must give the unfused engine's tokens and logprobs, on Llama and on Qwen2 (q/k/v
biases); the fused kernels must actually have run.
"""

from __future__ import annotations

import pytest

import kernels.gemv as gemv_kernels
from engine import LLM, SamplingParams
from engine.forward_context import forward_context
from engine.kernel_policy import KernelPolicy
from engine.layers.linear import Linear
from tests.models.utils import check_logprobs_close, ours_as_ref, spy_split_k

MAX_TOKENS = 4


def force_fused_on_cpu(monkeypatch, max_tokens: int = 2) -> dict[str, int]:
    """Take the fused path for CPU steps of <= ``max_tokens`` tokens; count the kernels' calls."""
    calls = {"gemv": 0, "silu_mul_gemv": 0, "add_rms_norm_gemv": 0}

    def use(linear, x, policy):
        return 0 < x.shape[0] <= max_tokens and (linear.adapter is None or linear.adapter.adds_nothing())

    monkeypatch.setattr(Linear, "uses_decode_gemv", use)
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


def test_gemv_override_from_the_policy(monkeypatch):
    """The policy's ``gemv`` overrides reach the GEMV launches as the wrappers' ``override``
    (``kernels.gemv`` reads no configuration itself): the forward context's policy, and outside one
    the default policy with CHORUS_KERNEL_POLICY applied."""
    import torch

    seen = []

    def spy(x, weight, bias=None, **kw):
        seen.append(kw["override"])
        return torch.zeros(x.shape[0], weight.shape[0])
    monkeypatch.setattr(gemv_kernels, "gemv", spy)
    monkeypatch.setattr(Linear, "uses_decode_gemv", lambda linear, x, policy: True)
    policy = KernelPolicy().with_overrides("gemv.use_dot=1, gemv.block_n=32")
    with forward_context(None, policy):
        Linear(8, [4])(torch.zeros(1, 8))
        monkeypatch.setenv("CHORUS_KERNEL_POLICY", "gemv.block_n=64")     # the context's policy wins
        Linear(8, [4])(torch.zeros(1, 8))
    Linear(8, [4])(torch.zeros(1, 8))                                    # no context: the string's
    assert seen == [(("block_n", 32), ("use_dot", 1))] * 2 + [(("block_n", 64),)]


# ----------------------------------------------------------------------------------------
# Split-K into the norm: o_proj / down_proj as partial products the add + RMSNorm sums
# ----------------------------------------------------------------------------------------
def test_split_k_never_on_cpu():
    """The shape rule is ``KernelPolicy.split_k_parts`` (tests/unit/test_kernel_policy.py); a Linear
    on CPU never splits, even under a policy whose rule would."""
    import torch

    policy = KernelPolicy(num_sms=132)
    assert policy.split_k_parts(64, 4096, 4096) == 2
    lin = Linear(4096, [4096]).to(torch.bfloat16)
    assert lin.split_k_parts(torch.zeros(64, 4096, dtype=torch.bfloat16), policy) == 1    # CPU: never


@pytest.mark.parametrize("case", ["llama", "qwen2", "lora"])
def test_split_k_in_the_model_matches_plain(case, tiny_llama_dir, tiny_qwen2_dir, tiny_prompts, tmp_path, monkeypatch):
    """The split-K path forced on CPU for every o_proj / down_proj call it may take: same tokens and
    logprobs as the plain GEMMs. Steps that carry an adapter never split: every projection with
    LoRA slots then adds an update (zero where the adapter has no weights) through its adapter, not
    ``Linear.forward_base``, even the o/down of an adapter on q/v only."""
    from lora.request import LoRARequest
    from tests.lora.utils import build_peft_adapter

    model_dir = str(tiny_qwen2_dir if case == "qwen2" else tiny_llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    prompts = tiny_prompts[:2]
    kw = dict(max_num_seqs=2, enable_prefix_caching=False)
    reqs = None
    if case == "lora":
        path = build_peft_adapter(tiny_llama_dir, tmp_path / case, r=4, lora_alpha=8,
                                  target_modules=["q_proj", "v_proj"], seed=5)
        reqs = [LoRARequest("a", 1, str(path))] * len(prompts)     # every step carries the adapter
        kw |= dict(enable_lora=True, max_loras=1, max_lora_rank=8)
    ref = LLM(model_dir, **kw).generate(prompts, params, lora_request=reqs, use_tqdm=False)

    def forced(linear, x, policy):
        eligible = x.dim() == 2 and x.is_contiguous() and linear.bias is None and (
            linear.adapter is None or linear.adapter.adds_nothing())
        return 2 if eligible else 1
    monkeypatch.setattr(Linear, "split_k_parts", forced)
    calls = spy_split_k(monkeypatch)
    outs = LLM(model_dir, **kw).generate(prompts, params, lora_request=reqs, use_tqdm=False)
    for i, (o, r) in enumerate(zip(outs, ref)):
        check_logprobs_close(ours_as_ref(r.outputs[0]), ours_as_ref(o.outputs[0]), name=f"prompt {i}")
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
    # o_proj and down_proj of both layers in every step (1 prefill + MAX_TOKENS - 1 decodes), or none
    num_steps = MAX_TOKENS
    assert calls == ([] if case == "lora" else [2] * (2 * 2 * num_steps)), (case, len(calls))


# ----------------------------------------------------------------------------------------
# Rotary + KV write inside the decode attention kernel
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, unfused_too", [("llama", True), ("qwen2", False)], ids=["llama", "qwen2"])
def test_triton_attention_with_fused_decode_rotary_matches_transformers(arch, unfused_too, tiny_llama_dir,
                                                                         tiny_qwen2_dir, tiny_prompts, monkeypatch):
    """The Triton attention backend forced on CPU (interpreter), as on CUDA: prefill steps rotate
    and write K/V (``rotary_write_kv``) and then attend; pure-decode steps run
    ``paged_decode_rotary``, whose cache writes later steps read. Greedy tokens and logprobs match
    transformers (the engine's policy with ``decode_fuse_rotary=1``: every decode step); with 0 no
    decode step takes the fused kernel (checked on Llama only: the policy's switch, not the
    architecture, decides it)."""
    from unittest.mock import Mock

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import engine.runner.runner as runner_module
    import kernels.paged_attention as pa
    from engine.attention import AttentionBackend
    from engine.layers.attention import PagedAttention
    from tests.models.utils import hf_greedy

    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = tiny_prompts[:3]
    refs = [hf_greedy(hf, tok.encode(p), MAX_TOKENS) for p in prompts]
    backends = []

    def triton_backend(device, policy=None, bf16_prefill=False, cpu_kernel_dir=None):
        backends.append(AttentionBackend("triton", policy))
        return backends[-1]
    monkeypatch.setattr(runner_module, "select_backend", triton_backend)
    monkeypatch.setattr(PagedAttention, "fuses_rotary_write",
                        lambda self, x: self.backend is not None and self.backend.name == "triton")
    spy = Mock(wraps=pa.paged_decode_rotary)
    monkeypatch.setattr(pa, "paged_decode_rotary", spy)
    monkeypatch.setenv("CHORUS_KERNEL_POLICY", "decode_fuse_rotary=1")   # auto: only batches below the SMs
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    llm = LLM(str(model_dir), max_num_seqs=4, enable_prefix_caching=False)
    policy = backends[-1].policy
    assert policy is llm.llm_engine.runner.policy and policy.decode_fuse_rotary == "1"
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (o, r) in enumerate(zip(outs, refs)):
        check_logprobs_close(r, ours_as_ref(o.outputs[0]), name=f"prompt {i}")
    num_layers = hf.config.num_hidden_layers
    assert spy.call_count == (MAX_TOKENS - 1) * num_layers         # every decode step, every layer
    if not unfused_too:
        return
    spy.reset_mock()
    monkeypatch.setenv("CHORUS_KERNEL_POLICY", "decode_fuse_rotary=0")
    llm = LLM(str(model_dir), max_num_seqs=4, enable_prefix_caching=False)
    assert backends[-1].policy.decode_fuse_rotary == "0"
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert spy.call_count == 0
    for i, (o, r) in enumerate(zip(outs, refs)):
        check_logprobs_close(r, ours_as_ref(o.outputs[0]), name=f"prompt {i}, unfused")


def test_decode_rotary_auto_policy():
    """auto fuses the batches whose requests x KV heads leave SMs idle (split-KV batches)."""
    import torch

    from kernels.paged_attention import decode_rotary_pays
    from kernels.utils import num_sms
    cpu = torch.device("cpu")
    sms = num_sms(cpu)
    assert decode_rotary_pays(1, 1, cpu) and decode_rotary_pays(sms - 1, 1, cpu)
    assert not decode_rotary_pays(sms, 1, cpu) and not decode_rotary_pays(sms // 2 + 1, 2, cpu)
