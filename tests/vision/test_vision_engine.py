"""Image requests in the one engine (tiny LLaVA, float32 CPU, against transformers): chunked
prefill with a budget smaller than one image, preemption in the middle of an image request,
images + adapters + text in one generate call, the encoder run once per image (and again after
eviction), and prefix-cache keys that carry the image."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from tests.models.utils import check_logprobs_close, ours_as_ref
from tests.vision.test_llava_parity import PROMPTS, hf_llava_greedy, params, save_llava_processor

NUM_IMAGE_TOKENS = 16   # tiny CLIP: (56 / 14)^2 patches, CLS dropped


@pytest.fixture(scope="module")
def llava_dir(tiny_llava_dir):
    save_llava_processor(tiny_llava_dir)
    return tiny_llava_dir


def test_chunked_prefill_smaller_than_one_image(llava_dir, images):
    """A 6-token step budget: the image's 16 placeholder tokens span three steps; its encoder
    output is computed once and read by each chunk."""
    llm = LLM(str(llava_dir), device="cpu", dtype="float32", max_num_batched_tokens=6, max_model_len=256)
    prompts = [{"prompt": PROMPTS[1], "multi_modal_data": {"image": [images[0], images[1]]}},
               {"prompt": PROMPTS[0], "multi_modal_data": {"image": images[2]}}]
    outs = llm.generate(prompts, params(), use_tqdm=False)
    for p, out in zip(prompts, outs):
        imgs = p["multi_modal_data"]["image"]
        ref = hf_llava_greedy(llava_dir, p["prompt"], imgs if isinstance(imgs, list) else [imgs])
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), p["prompt"])
    assert llm.llm_engine.runner.num_encoded_items == 3
    assert llm.llm_engine.core.scheduler.num_steps >= 8


def test_preemption_in_the_middle_of_an_image_request(llava_dir, images):
    """Few KV blocks and long outputs: requests are preempted (some mid-prompt, inside an image)
    and recomputed, with their images re-read from the encoder cache or re-encoded."""
    llm = LLM(str(llava_dir), device="cpu", dtype="float32", block_size=4, num_gpu_blocks_override=24,
              max_num_batched_tokens=12, max_model_len=256)
    prompts = [{"prompt": PROMPTS[0], "multi_modal_data": {"image": img}} for img in images[:3]]
    outs = llm.generate(prompts, params(max_tokens=30), use_tqdm=False)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    for p, out in zip(prompts, outs):
        ref = hf_llava_greedy(llava_dir, p["prompt"], [p["multi_modal_data"]["image"]], max_new_tokens=30)
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), "preempted")
    sched = llm.llm_engine.core.scheduler
    assert not any(sched.encoder_cache_manager.cached.values())   # no references left


def test_encoder_runs_once_per_image_and_again_after_eviction(llava_dir, images):
    # Encoder cache of 2 images (32 embeddings); budget too.
    llm = LLM(str(llava_dir), device="cpu", dtype="float32", max_num_batched_tokens=64, max_model_len=256,
              max_num_encoder_input_tokens=2 * NUM_IMAGE_TOKENS, encoder_cache_size=2 * NUM_IMAGE_TOKENS)
    runner, sched = llm.llm_engine.runner, llm.llm_engine.core.scheduler
    same = [{"prompt": f"Question {i}: <image> describe", "multi_modal_data": {"image": images[0]}} for i in range(6)]
    outs = llm.generate(same, params(), use_tqdm=False)
    assert runner.num_encoded_items == 1 and len(outs) == 6
    assert sched.encoder_cache_manager.num_hits == 5
    # Two other images fill the cache: the first one is evicted (LRU), then encoded again.
    llm.generate([{"prompt": "<image> x", "multi_modal_data": {"image": img}} for img in images[1:3]], params(),
                 use_tqdm=False)
    assert runner.num_encoded_items == 3 and len(runner.encoder_cache) <= 2
    llm.generate(same[:1], params(), use_tqdm=False)
    assert runner.num_encoded_items == 4


def test_prefix_cache_hits_for_the_same_image_and_misses_for_another(llava_dir, images):
    llm = LLM(str(llava_dir), device="cpu", dtype="float32", max_model_len=256)
    prompt = "A long shared preamble of text that fills a few blocks. <image> What is it?"
    first = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images[0]}}, params(), use_tqdm=False)[0]
    same = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images[0]}}, params(), use_tqdm=False)[0]
    other = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images[1]}}, params(), use_tqdm=False)[0]
    n = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens >= n - 16           # everything but the last partial block
    text_before = prompt.index("<image>")
    assert other.num_cached_tokens < len(llm.get_tokenizer().encode(prompt[:text_before])) + 1
    assert same.outputs[0].token_ids == first.outputs[0].token_ids


def test_images_adapters_and_text_in_one_generate_call(tmp_path, llava_dir, images):
    """A LoRA adapter on the language model (PEFT, transformers 5 module names) with and without
    images, beside base-model image and text requests, in one call."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlavaForConditionalGeneration

    from lora.request import LoRARequest

    base = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32)
    torch.manual_seed(3)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                     target_modules=r".*language_model.*\.(q_proj|v_proj|o_proj|gate_proj|down_proj)")
    get_peft_model(base, cfg).save_pretrained(tmp_path / "sql")
    ref_model = PeftModel.from_pretrained(
        LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32), tmp_path / "sql").eval()

    llm = LLM(str(llava_dir), device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8, max_model_len=256)
    lora = LoRARequest("sql", 1, str(tmp_path / "sql"))
    reqs = [({"prompt": PROMPTS[0], "multi_modal_data": {"image": images[0]}}, lora, [images[0]]),
            ({"prompt": PROMPTS[0], "multi_modal_data": {"image": images[0]}}, None, [images[0]]),
            ({"prompt": PROMPTS[2]}, lora, []),
            ({"prompt": PROMPTS[2]}, None, [])]
    outs = llm.generate([r for r, _, _ in reqs], params(), lora_request=[lr for _, lr, _ in reqs], use_tqdm=False)
    for (req, lr, imgs), out in zip(reqs, outs):
        ref = hf_llava_greedy(llava_dir, req["prompt"], imgs, model=ref_model if lr else None)
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), f"{req['prompt']} lora={lr is not None}")
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids   # the adapter matters with images


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_graph_path_with_images_matches_eager(family, llava_dir, tiny_qwen2_vl_dir, images):
    """Mixed graph steps with image tokens (their encoder rows and, for Qwen2-VL, [3, T] M-RoPE
    positions read from static buffers), run on CPU by replaying the graph path eagerly, equal the
    eager engine; decode steps take decode graphs."""
    from tests.models.utils import EagerReplayGraphs

    model_dir = llava_dir if family == "llava" else tiny_qwen2_vl_dir
    img = "<image>" if family == "llava" else "<|vision_start|><|image_pad|><|vision_end|>"
    prompts = [{"prompt": f"Look: {img} what?", "multi_modal_data": {"image": images[i]}} for i in range(3)]
    prompts.append({"prompt": "The quick brown fox"})
    kw = dict(device="cpu", dtype="float32", max_num_seqs=6, max_num_batched_tokens=40, max_model_len=256)
    ref = LLM(str(model_dir), **kw).generate(prompts, params(), use_tqdm=False)

    llm = LLM(str(model_dir), **kw)
    runner = llm.llm_engine.runner
    runner.buffers.enable_media(40, runner.model.shape.hidden_size, runner.dtype,
                                runner.model.capabilities.mrope)
    graphs = EagerReplayGraphs.install(llm, token_sizes=[16, 24, 40])
    outs = llm.generate(prompts, params(), use_tqdm=False)
    for i, (o, r) in enumerate(zip(outs, ref)):
        check_logprobs_close(ours_as_ref(r.outputs[0]), ours_as_ref(o.outputs[0]), name=f"{family} prompt {i}")
    assert graphs.num_mixed_replays > 0 and graphs.num_replays > graphs.num_mixed_replays
