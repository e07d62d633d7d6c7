"""tensor_parallel_size 2 on two CUDA GPUs (NCCL) against size 1, bfloat16, on the tiny checkpoints.

The rule is vLLM's top-5 rule (tests/models/utils.py): tokens match, or at the first divergence each
side's token is in the other's top-5 (bf16 sums in a different order across two GPUs).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.models.utils import check_logprobs_close, ours_as_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

MAX_TOKENS = 24
BF16_LOGPROB_ATOL = 0.25


def _generate(model_dir, prompts, tp: int, lora_request=None, max_num_seqs: int = 16, **engine_kw) -> list:
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3,
              tensor_parallel_size=tp, max_num_seqs=max_num_seqs, **engine_kw)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
        return [o.outputs[0] for o in outputs]
    finally:
        llm.llm_engine.core.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_matches_tp1_on_two_gpus(arch, tiny_llama_dir, tiny_qwen2_dir, tiny_prompts):
    """TP=2 (eager: resolve_engine_config turns CUDA graphs off there) against TP=1 with graphs."""
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    ref = _generate(model_dir, tiny_prompts, tp=1)
    ours = _generate(model_dir, tiny_prompts, tp=2)
    for i, (a, b) in enumerate(zip(ref, ours)):
        check_logprobs_close(ours_as_ref(a), ours_as_ref(b), f"{arch} prompt {i}", atol=BF16_LOGPROB_ATOL)


def test_tp2_with_adapters_matches_tp1(tiny_llama_dir, tiny_prompts, tmp_path):
    """Two adapters on all seven projections next to base requests: TP=2 against TP=1. On CUDA a
    decode-sized step with an adapter hands the row-parallel layers a strided view of one stacked GEMM
    (base + every slot's shrink), which the all-reduce must take (failed before that, 2026-12-01)."""
    from lora.request import LoRARequest
    from tests.lora.utils import ALL_TARGETS, build_peft_adapter

    adapters = [build_peft_adapter(tiny_llama_dir, tmp_path / name, r=r, lora_alpha=2 * r,
                                   target_modules=ALL_TARGETS, seed=seed)
                for name, r, seed in (("a", 8, 1), ("b", 4, 2))]
    prompts, loras = [], []
    for i, path in enumerate([None, *adapters]):
        for p in tiny_prompts:
            prompts.append(p)
            loras.append(None if path is None else LoRARequest(path.name, i, str(path)))
    lora_kw = dict(max_num_seqs=32, enable_lora=True, max_loras=2, max_lora_rank=8)
    ref = _generate(tiny_llama_dir, prompts, tp=1, lora_request=loras, **lora_kw)
    ours = _generate(tiny_llama_dir, prompts, tp=2, lora_request=loras, **lora_kw)
    for i, (a, b) in enumerate(zip(ref, ours)):
        check_logprobs_close(ours_as_ref(a), ours_as_ref(b), f"request {i}", atol=BF16_LOGPROB_ATOL)
    n = len(tiny_prompts)
    assert any(list(x.token_ids) != list(y.token_ids) for x, y in zip(ref[:n], ref[n:2 * n]))
