"""Greedy parity with transformers on CUDA in bfloat16 (tiny checkpoints), CUDA graphs on and off.

The rule is vLLM's (tests/models/utils.py): tokens match, or at the first divergence each side's
token is in the other's top-5. bf16 logprobs of two different kernels differ by ~1e-2, so the
logprob tolerance is loose; the token rule is what this checks.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.models.utils import check_logprobs_close, hf_greedy, ours_as_ref, spy_split_k

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_TOKENS = 24
BF16_LOGPROB_ATOL = 0.25


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def cuda_refs(request, tiny_llama_dir, tiny_qwen2_dir, tiny_prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    tok = AutoTokenizer.from_pretrained(d)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    refs = [hf_greedy(hf, tok.encode(p), MAX_TOKENS) for p in tiny_prompts]
    del hf
    torch.cuda.empty_cache()
    return d, tiny_prompts, refs


def _params():
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def _check(outputs, refs, prompts) -> int:
    exact = 0
    for i, (out, ref) in enumerate(zip(outputs, refs)):
        n = check_logprobs_close(ref, ours_as_ref(out.outputs[0]), name=f"prompt {i}", atol=BF16_LOGPROB_ATOL)
        exact += n == len(ref.token_ids)
    return exact


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_gpu_parity_bf16(cuda_refs, enforce_eager, async_scheduling):
    d, prompts, refs = cuda_refs
    llm = LLM(d, dtype="bfloat16", enforce_eager=enforce_eager, async_scheduling=async_scheduling,
              gpu_memory_utilization=0.5, max_num_seqs=16)
    outputs = llm.generate(prompts, _params(), use_tqdm=False)
    exact = _check(outputs, refs, prompts)
    assert exact >= 1
    graphs = llm.llm_engine.runner.graphs
    if enforce_eager:
        assert graphs is None
    else:
        assert graphs is not None and graphs.num_replays >= MAX_TOKENS - 2
        assert graphs.num_mixed_replays >= 1          # the prefill step ran as a mixed-step graph


def test_gpu_parity_chunked_prefill_and_preemption(cuda_refs):
    """Mixed prefill-chunk + decode steps (mixed-step graphs, Triton attention over cached
    prefixes) and recompute after preemption."""
    d, prompts, refs = cuda_refs
    llm = LLM(d, dtype="bfloat16", max_num_batched_tokens=16, max_num_seqs=4, num_gpu_blocks_override=10,
              block_size=16)
    outputs = llm.generate(prompts, _params(), use_tqdm=False)
    _check(outputs, refs, prompts)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    assert llm.llm_engine.runner.graphs.num_mixed_replays > 0   # chunk + decode steps as graphs


def test_gpu_stop_token_with_async_scheduling(cuda_refs):
    """A request stopped by a token mid-run drops the token computed one step ahead."""
    d, prompts, _ = cuda_refs
    llm = LLM(d, dtype="bfloat16", enable_prefix_caching=False)
    full = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop = full[5]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop])
    out = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full[:full.index(stop) + 1]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_gpu_parity_split_k(cuda_refs, enforce_eager, monkeypatch):
    """o_proj / down_proj as split-K partials summed in the add + RMSNorm (``Linear.forward_base``;
    the tiny checkpoints' K is below ``engine.kernel_policy.SPLIT_K_MIN_K``, lowered here), in graphs
    and eagerly."""
    import engine.kernel_policy as kernel_policy

    monkeypatch.setattr(kernel_policy, "SPLIT_K_MIN_K", 16)
    calls = spy_split_k(monkeypatch)
    d, prompts, refs = cuda_refs
    llm = LLM(d, dtype="bfloat16", enforce_eager=enforce_eager, gpu_memory_utilization=0.5, max_num_seqs=16)
    exact = _check(llm.generate(prompts, _params(), use_tqdm=False), refs, prompts)
    assert exact >= 1 and calls and set(calls) == {2}
