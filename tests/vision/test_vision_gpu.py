"""Vision models on CUDA (tiny checkpoints, float32 so the comparison is tight): Triton kernels,
CUDA graphs (decode graphs, and mixed graphs whose steps carry image tokens and M-RoPE positions)
and eager steps against transformers on the CPU."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from tests.models.utils import check_logprobs_close, ours_as_ref
from tests.vision.test_llava_parity import hf_llava_greedy, params, save_llava_processor
from tests.vision.test_qwen2_vl_parity import hf_qwen2_vl_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ATOL = 2e-3   # float32 on two devices (TF32 off): reductions in another order


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_vision_gpu_parity(family, enforce_eager, tiny_llava_dir, tiny_qwen2_vl_dir, images):
    torch.backends.cuda.matmul.allow_tf32 = False
    if family == "llava":
        save_llava_processor(tiny_llava_dir)
        d, img, ref_fn = tiny_llava_dir, "<image>", hf_llava_greedy
    else:
        d, img, ref_fn = tiny_qwen2_vl_dir, "<|vision_start|><|image_pad|><|vision_end|>", hf_qwen2_vl_greedy
    prompts = [{"prompt": f"Look: {img} what is it?", "multi_modal_data": {"image": im}} for im in images]
    prompts.append({"prompt": "The quick brown fox"})
    llm = LLM(str(d), dtype="float32", enforce_eager=enforce_eager, gpu_memory_utilization=0.3,
              max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512)
    outs = llm.generate(prompts, params(), use_tqdm=False)
    for p, out in zip(prompts, outs):
        mm = p.get("multi_modal_data")
        ref = ref_fn(d, p["prompt"], [mm["image"]] if mm else [])
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), f"{family} {p['prompt'][:12]}", atol=ATOL)
    graphs = llm.llm_engine.runner.graphs
    if not enforce_eager:
        assert graphs.num_mixed_replays > 0 and graphs.num_replays > graphs.num_mixed_replays
