"""Qwen2-VL against transformers on a tiny random checkpoint, float32 on CPU: dynamic resolution
(each image size gives another token count), M-RoPE positions, greedy tokens equal and logprobs
within 1e-3."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from engine.llm import LLM
from engine.models.qwen2_vl import mrope_positions
from engine.sampling_params import SamplingParams
from tests.models.utils import RefOutput, check_logprobs_close, ours_as_ref
from tests.vision.utils import hf_generate_greedy
from tests.vision.conftest import build_tiny_qwen2_vl

MAX_TOKENS = 8
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = [f"{IMG}What is in the picture?", f"Hello {IMG} and {IMG} again", "The quick brown fox"]


def hf_inputs(model_dir, prompt: str, images) -> dict:
    """What transformers' Qwen2VLProcessor makes (it needs torchvision for its video half, so its
    two steps are done here): image processor outputs, each <|image_pad|> repeated t*h*w/4 times."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = {}
    if images:
        image_processor = AutoImageProcessor.from_pretrained(model_dir, use_fast=False)   # the PIL backend
        out = dict(image_processor(images=images, return_tensors="pt"))
        parts = prompt.split("<|image_pad|>")
        counts = [int(t * h * w) // 4 for t, h, w in out["image_grid_thw"].tolist()]
        prompt = parts[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, parts[1:]))
    out["input_ids"] = torch.tensor([tok.encode(prompt)])
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    out["mm_token_type_ids"] = (out["input_ids"] == tok.convert_tokens_to_ids("<|image_pad|>")).int()
    return out


def hf_qwen2_vl_greedy(model_dir, prompt: str, images, max_new_tokens: int = MAX_TOKENS) -> RefOutput:
    model = _hf_model(str(model_dir))
    inputs = hf_inputs(model_dir, prompt, images)
    return hf_generate_greedy(model, inputs, max_new_tokens)


@functools.lru_cache(maxsize=2)
def _hf_model(model_dir: str):
    from transformers import AutoModelForImageTextToText
    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen(tiny_qwen2_vl_dir):
    return LLM(str(tiny_qwen2_vl_dir), device="cpu", dtype="float32", max_num_seqs=8)


def test_mrope_positions_match_transformers(tiny_qwen2_vl_dir, images):
    """Our [3, P] table and delta equal transformers' get_rope_index on a two-image prompt."""
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_qwen2_vl_dir, dtype=torch.float32)
    inputs = hf_inputs(tiny_qwen2_vl_dir, PROMPTS[1], [images[0], images[2]])
    ids = inputs["input_ids"]
    pad = model.config.image_token_id
    ref_pos, ref_delta = model.model.get_rope_index(ids, (ids == pad).int(), inputs["image_grid_thw"])
    row = ids[0].tolist()
    runs, i = [], 0
    for k, (t, h, w) in enumerate(inputs["image_grid_thw"].tolist()):
        start = row.index(pad, i)
        n = t * h * w // 4
        runs.append((start, n, (t, h, w)))
        i = start + n
    ours, delta = mrope_positions(len(row), runs, merge_size=2)
    np.testing.assert_array_equal(ours, ref_pos[:, 0].numpy())
    assert delta == int(ref_delta[0, 0])


def test_image_sizes_decide_tokens(qwen, tiny_qwen2_vl_dir, images):
    for img in images[:3]:
        ref = hf_qwen2_vl_greedy(tiny_qwen2_vl_dir, PROMPTS[0], [img])
        out = qwen.generate({"prompt": PROMPTS[0], "multi_modal_data": {"image": img}}, params(), use_tqdm=False)
        check_logprobs_close(ref, ours_as_ref(out[0].outputs[0]), f"qwen2-vl {img.size}")


def test_two_images_and_text_in_one_batch(qwen, tiny_qwen2_vl_dir, images):
    reqs = [({"prompt": PROMPTS[1], "multi_modal_data": {"image": [images[1], images[3]]}}, [images[1], images[3]]),
            ({"prompt": PROMPTS[2]}, [])]
    outs = qwen.generate([r for r, _ in reqs], params(), use_tqdm=False)
    for (req, imgs), out in zip(reqs, outs):
        ref = hf_qwen2_vl_greedy(tiny_qwen2_vl_dir, req["prompt"], imgs)
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), req["prompt"])


def test_legacy_layout(tmp_path, tiny_qwen2_vl_dir, images):
    d = build_tiny_qwen2_vl(tmp_path / "m", legacy_layout=True)
    llm = LLM(str(d), device="cpu", dtype="float32", max_num_seqs=4)
    ref = hf_qwen2_vl_greedy(tiny_qwen2_vl_dir, PROMPTS[0], [images[2]])   # same seed, 5.x layout
    out = llm.generate({"prompt": PROMPTS[0], "multi_modal_data": {"image": images[2]}}, params(), use_tqdm=False)
    check_logprobs_close(ref, ours_as_ref(out[0].outputs[0]), "legacy layout")


def test_qwen2_5_vl(tmp_path, images):
    """Qwen2.5-VL: the window-attention tower (a full-attention block among window blocks) with the
    same language model, positions and processor; a large image spans several windows."""
    d = build_tiny_qwen2_vl(tmp_path / "m", version="2.5")
    llm = LLM(str(d), device="cpu", dtype="float32", max_num_seqs=4)
    for img in (images[2], images[0]):
        ref = hf_qwen2_vl_greedy(d, PROMPTS[0], [img])
        out = llm.generate({"prompt": PROMPTS[0], "multi_modal_data": {"image": img}}, params(), use_tqdm=False)
        check_logprobs_close(ref, ours_as_ref(out[0].outputs[0]), f"qwen2.5-vl {img.size}")


def test_chunked_prefill_across_images(tiny_qwen2_vl_dir, images):
    """A 7-token step budget: chunks start and end inside images, each chunk's M-RoPE rows cut from
    the prompt's table."""
    llm = LLM(str(tiny_qwen2_vl_dir), device="cpu", dtype="float32", max_num_batched_tokens=7, max_model_len=512)
    imgs = [images[2], images[1]]
    out = llm.generate({"prompt": PROMPTS[1], "multi_modal_data": {"image": imgs}}, params(), use_tqdm=False)
    ref = hf_qwen2_vl_greedy(tiny_qwen2_vl_dir, PROMPTS[1], imgs)
    check_logprobs_close(ref, ours_as_ref(out[0].outputs[0]), "chunked")
    assert llm.llm_engine.core.scheduler.num_steps > len(out[0].prompt_token_ids) // 7
