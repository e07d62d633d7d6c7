"""Greedy parity with transformers on tiny random Llama and Qwen2 checkpoints (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.models.utils import check_logprobs_close, hf_greedy, ours_as_ref

MAX_TOKENS = 16


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch_setup(request, tiny_llama_dir, tiny_qwen2_dir, tiny_prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    tok = AutoTokenizer.from_pretrained(d)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    prompt_ids = [tok.encode(p) for p in tiny_prompts]
    refs = [hf_greedy(hf, ids, MAX_TOKENS) for ids in prompt_ids]
    return d, tiny_prompts, refs


def _params(**kw):
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5, **kw)


def _check_all(outputs, refs, prompts):
    assert [o.prompt for o in outputs] == prompts  # input order
    for i, (out, ref) in enumerate(zip(outputs, refs)):
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), name=f"prompt {i}")


def test_parity_default(arch_setup):
    d, prompts, refs = arch_setup
    llm = LLM(d, seed=0)
    outputs = llm.generate(prompts, _params(), use_tqdm=False)
    _check_all(outputs, refs, prompts)
    # Most prompts should match exactly; divergence is only allowed at near-ties.
    exact = sum(o.outputs[0].token_ids == r.token_ids for o, r in zip(outputs, refs))
    assert exact >= 6
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert llm.llm_engine.get_stats().max_reqs_per_step == len(prompts)


def test_parity_chunked_prefill(arch_setup):
    d, prompts, refs = arch_setup
    llm = LLM(d, max_num_batched_tokens=8, max_num_seqs=4)
    outputs = llm.generate(prompts, _params(), use_tqdm=False)
    _check_all(outputs, refs, prompts)


def test_parity_preemption(arch_setup):
    d, prompts, refs = arch_setup
    llm = LLM(d, num_gpu_blocks_override=12, block_size=16)
    outputs = llm.generate(prompts, _params(), use_tqdm=False)
    _check_all(outputs, refs, prompts)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0.0  # nothing leaked


def test_parity_prefix_caching(arch_setup, tiny_llama_dir):
    d, prompts, refs = arch_setup
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shared = ("Paged attention keeps the KV cache in fixed-size blocks. A scheduler hands out one token "
              "budget per step to running and waiting requests. ")
    tails = ["The quick brown fox", "Hello", "What is the capital of France?"]
    shared_prompts = [shared + t for t in tails]
    tok = AutoTokenizer.from_pretrained(d)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    shared_refs = [hf_greedy(hf, tok.encode(p), MAX_TOKENS) for p in shared_prompts]
    llm = LLM(d, enable_prefix_caching=True)
    first = llm.generate(shared_prompts[:1], _params(), use_tqdm=False)
    rest = llm.generate(shared_prompts[1:], _params(), use_tqdm=False)
    _check_all(first + rest, shared_refs, shared_prompts)
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits > 0
    assert all(o.num_cached_tokens >= 16 for o in rest)
    # Outputs are unchanged by caching: the same prompt again, fully cached but the last block.
    again = llm.generate(shared_prompts[:1], _params(), use_tqdm=False)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
