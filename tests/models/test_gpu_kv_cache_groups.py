"""KV cache groups on CUDA (``engine.kv_cache_groups``): a tiny 6-layer Gemma 3 (window 10; 4 sliding layers,
2 global: 3 groups of 2 layers sharing 2 slots of K/V tensors) in bfloat16 with prompts far past the window,
CUDA graphs on and off, each group's layers reading their own block table through the Triton kernels (and the
graphs' per-group buffers). The token rule of tests/models/test_gpu_parity.py against transformers; a small
cache with chunked prefill preempts and recomputes; a repeated prompt hits the prefix cache in every group."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import TINY_PROMPTS, build_tiny_checkpoint
from tests.models.utils import check_logprobs_close, hf_greedy, ours_as_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_TOKENS = 24
WINDOW = 10
BF16_LOGPROB_ATOL = 0.25
LONG_PROMPT = " ".join(TINY_PROMPTS) + " " + " ".join(TINY_PROMPTS[::-1])


@pytest.fixture(scope="module")
def gemma3_refs(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = build_tiny_checkpoint(tmp_path_factory.mktemp("gemma3-groups") / "gemma3", "gemma3_text", seed=28,
                              hidden_size=48, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                              num_hidden_layers=6, sliding_window_pattern=3, query_pre_attn_scalar=20,
                              sliding_window=WINDOW)
    tok = AutoTokenizer.from_pretrained(d)
    prompts = [tok.encode(LONG_PROMPT), tok.encode(TINY_PROMPTS[1]) * 3, tok.encode(TINY_PROMPTS[2]) * 4]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    del hf
    torch.cuda.empty_cache()
    return d, prompts, refs


def _generate(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _check(outputs, refs) -> None:
    for i, (out, ref) in enumerate(zip(outputs, refs)):
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), name=f"prompt {i}", atol=BF16_LOGPROB_ATOL)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_groups_on_cuda_match_transformers(gemma3_refs, enforce_eager):
    d, prompts, refs = gemma3_refs
    llm = LLM(d, dtype="bfloat16", enforce_eager=enforce_eager, gpu_memory_utilization=0.5, max_num_seqs=8,
              block_size=16)
    groups = llm.llm_engine.runner.kv_cache.groups
    assert (groups.num_groups, groups.group_size) == (3, 2)
    _check(_generate(llm, prompts), refs)
    if not enforce_eager:
        assert llm.llm_engine.runner.graphs.num_replays >= MAX_TOKENS - 2
    second = _generate(llm, prompts[:1])                             # the same prompt: a prefix hit
    assert second[0].num_cached_tokens > 0
    _check(second, refs[:1])


def test_groups_on_cuda_chunked_prefill_and_preemption(gemma3_refs):
    d, prompts, refs = gemma3_refs
    llm = LLM(d, dtype="bfloat16", max_num_batched_tokens=16, max_num_seqs=3, block_size=16,
              num_gpu_blocks_override=32, enable_prefix_caching=False)
    _check(_generate(llm, prompts), refs)
    assert llm.llm_engine.get_stats().num_preemptions > 0
