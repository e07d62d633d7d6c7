"""LLaVA against transformers on tiny random checkpoints, float32 on CPU: greedy tokens equal and
logprobs within 1e-3 (vLLM's rule at a divergence)."""

from __future__ import annotations

import functools

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.models.utils import RefOutput, check_logprobs_close, ours_as_ref
from tests.vision.utils import hf_generate_greedy
from tests.vision.conftest import build_tiny_llava

MAX_TOKENS = 8


def hf_llava_greedy(model_dir, prompt: str, images, max_new_tokens: int = MAX_TOKENS, model=None) -> RefOutput:
    """transformers' processor (placeholder expansion, pixel values) + generate, greedy, EOS ignored
    (``model``: e.g. a PeftModel over the checkpoint; default the checkpoint itself)."""
    proc = _hf_processor(str(model_dir))
    if model is None:
        model = _hf_model(str(model_dir))
    inputs = proc(text=prompt, images=images or None, return_tensors="pt")
    return hf_generate_greedy(model, dict(inputs), max_new_tokens)


@functools.lru_cache(maxsize=4)
def _hf_model(model_dir: str):
    from transformers import LlavaForConditionalGeneration
    return LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=4)
def _hf_processor(model_dir: str):
    """transformers' processor with its PIL image backend (the torchvision one, where installed,
    resizes differently; ours follows the PIL one)."""
    from transformers import AutoImageProcessor, AutoProcessor
    proc = AutoProcessor.from_pretrained(model_dir)
    proc.image_processor = AutoImageProcessor.from_pretrained(model_dir, use_fast=False)
    return proc


def params(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, ignore_eos=True)


def save_llava_processor(model_dir, strategy="default", additional=1):
    """transformers' LlavaProcessor for the reference (expands <image> as the model counts embeddings)."""
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaProcessor

    proc = LlavaProcessor(image_processor=AutoImageProcessor.from_pretrained(model_dir),
                          tokenizer=AutoTokenizer.from_pretrained(model_dir), patch_size=14,
                          vision_feature_select_strategy=strategy, num_additional_image_tokens=additional,
                          image_token="<image>")
    proc.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def llava(tiny_llava_dir):
    save_llava_processor(tiny_llava_dir)
    return LLM(str(tiny_llava_dir), device="cpu", dtype="float32", max_num_seqs=8)


PROMPTS = ["<image>\nWhat is in the picture?", "Hello <image> and <image> again", "The quick brown fox"]


def test_one_image_two_sizes(llava, tiny_llava_dir, images):
    for img in images[:2]:
        prompt = PROMPTS[0]
        ref = hf_llava_greedy(tiny_llava_dir, prompt, [img])
        out = llava.generate({"prompt": prompt, "multi_modal_data": {"image": img}}, params(), use_tqdm=False)
        check_logprobs_close(ref, ours_as_ref(out[0].outputs[0]), f"llava {img.size}")


def test_two_images_one_prompt_mixed_batch(llava, tiny_llava_dir, images):
    """Two images in one prompt, one image, and a text-only prompt in one generate call."""
    reqs = [({"prompt": PROMPTS[1], "multi_modal_data": {"image": [images[0], images[2]]}}, [images[0], images[2]]),
            ({"prompt": PROMPTS[0], "multi_modal_data": {"image": images[3]}}, [images[3]]),
            ({"prompt": PROMPTS[2]}, [])]
    outs = llava.generate([r for r, _ in reqs], params(), use_tqdm=False)
    for (req, imgs), out in zip(reqs, outs):
        ref = hf_llava_greedy(tiny_llava_dir, req["prompt"], imgs)
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), req["prompt"])


@pytest.mark.parametrize("tower,strategy,layer,legacy,text", [
    ("siglip", "default", -1, False, "qwen2"), ("clip", "full", [-2, 1], True, "llama")])
def test_variants(tmp_path, images, tower, strategy, layer, legacy, text):
    """SigLIP tower with a Qwen2 language model; 'full' strategy (CLS kept), a list of feature layers
    and the transformers 4.x layout."""
    d = build_tiny_llava(tmp_path / "m", tower=tower, strategy=strategy, feature_layer=layer, legacy_layout=legacy,
                         text=text)
    has_cls = tower == "clip"
    save_llava_processor(d, strategy, additional=int(has_cls))
    llm = LLM(str(d), device="cpu", dtype="float32", max_num_seqs=4)
    ref_dir = d
    if legacy:   # transformers 5 reads only its own layout: the reference comes from a 5.x copy
        ref_dir = build_tiny_llava(tmp_path / "ref", tower=tower, strategy=strategy, feature_layer=layer, text=text)
        save_llava_processor(ref_dir, strategy, additional=int(has_cls))
    ref = hf_llava_greedy(ref_dir, PROMPTS[0], [images[1]])
    out = llm.generate({"prompt": PROMPTS[0], "multi_modal_data": {"image": images[1]}}, params(), use_tqdm=False)
    check_logprobs_close(ref, ours_as_ref(out[0].outputs[0]), f"{tower}/{strategy}/{layer}")
