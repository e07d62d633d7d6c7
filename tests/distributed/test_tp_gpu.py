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


def _generate(model_dir, prompts, tp: int) -> list:
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3,
              tensor_parallel_size=tp)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.core.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_matches_tp1_on_two_gpus(arch, tiny_llama_dir, tiny_qwen2_dir, tiny_prompts):
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    ref = _generate(model_dir, tiny_prompts, tp=1)
    ours = _generate(model_dir, tiny_prompts, tp=2)
    for i, (a, b) in enumerate(zip(ref, ours)):
        check_logprobs_close(ours_as_ref(a), ours_as_ref(b), f"{arch} prompt {i}", atol=BF16_LOGPROB_ATOL)
