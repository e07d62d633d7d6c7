"""Gemma 3 with images (``Gemma3ForConditionalGeneration``) against transformers on a tiny random
checkpoint (tiny SigLIP + tiny Gemma 3 text), float32 on CPU: greedy tokens equal (or top-5 at a
divergence) and logprobs within 1e-3.

The reference is transformers' processor path: ``token_type_ids`` given, so one image's tokens attend to each
other both ways (``test_bidirectional_attention_is_transformers_processor_path`` shows it differs from the
causal path). The text model's sliding layers have a window of 10 tokens, shorter than every prompt with an
image, so the window and the image spans combine (AND(window, OR(causal, same image)))."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.conftest import build_tokenizer
from tests.models.utils import RefOutput, check_logprobs_close, ours_as_ref
from tests.vision.utils import hf_generate_greedy

MAX_TOKENS = 8
WINDOW = 10
MAX_LEN = 512
BOI, IMG, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
MM_TOKENS = 4
CHAT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['content'] is string %}"
        "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
        "{{ '<start_of_image>' }}{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
        "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def build_tiny_gemma3_vl(out_dir: Path, seed: int = 0) -> Path:
    """transformers' own ``Gemma3ForConditionalGeneration``: SigLIP 56 px / 14 px patches (16 patches,
    pooled 2x2 to 4 tokens), a 2-layer Gemma 3 text model (one sliding layer, window 10, one global), every
    Gemma RMSNorm (text norms and ``mm_soft_emb_norm``) drawn nonzero."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        SiglipVisionConfig,
    )

    tok = build_tokenizer((BOI, IMG, EOI))
    ids = {t: tok.convert_tokens_to_ids(t) for t in (BOI, IMG, EOI)}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                sliding_window_pattern=2, query_pre_attn_scalar=24, final_logit_softcapping=5.0,
                max_position_embeddings=1024, initializer_range=0.2, eos_token_id=tok.eos_token_id,
                bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=56, patch_size=14)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=MM_TOKENS,
                       image_token_index=ids[IMG], boi_token_index=ids[BOI], eoi_token_index=ids[EOI])
    cfg.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():   # transformers initializes the projector at zero: make the image matter
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.3)
    model.save_pretrained(out_dir)
    tok.chat_template = CHAT
    tok.save_pretrained(out_dir)
    Gemma3ImageProcessor(size={"height": 56, "width": 56}).save_pretrained(out_dir)
    path = out_dir / "model.safetensors"
    weights = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for name, w in weights.items():
        if name.endswith("norm.weight") and "vision_tower" not in name:
            weights[name] = torch.rand(w.shape, generator=gen, dtype=w.dtype) - 0.5
    save_file(weights, path, metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def gemma3_vl_dir(tmp_path_factory) -> Path:
    return build_tiny_gemma3_vl(tmp_path_factory.mktemp("tiny-gemma3-vl"))


@pytest.fixture(scope="module")
def llm(gemma3_vl_dir):
    return LLM(str(gemma3_vl_dir), device="cpu", dtype="float32", max_num_seqs=8, max_model_len=MAX_LEN)


@functools.lru_cache(maxsize=2)
def _hf(model_dir: str):
    from transformers import AutoImageProcessor, AutoTokenizer, Gemma3ForConditionalGeneration
    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir), AutoImageProcessor.from_pretrained(model_dir,
                                                                                               use_fast=False)


def hf_inputs(model_dir: Path, prompt: str, images) -> dict:
    """What transformers' Gemma3Processor makes: each <start_of_image> -> "\\n\\n" boi img x N eoi "\\n\\n"
    (text level, then tokenized), pixel values by transformers' Gemma3ImageProcessor (PIL backend)."""
    _, tok, proc = _hf(str(model_dir))
    full = f"\n\n{BOI}{IMG * MM_TOKENS}{EOI}\n\n"
    ids = tok(prompt.replace(BOI, full), add_special_tokens=False, return_tensors="pt")["input_ids"]
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if images:
        inputs["pixel_values"] = proc(images, return_tensors="pt")["pixel_values"]
    return inputs


def hf_greedy(model_dir: Path, prompt: str, images) -> RefOutput:
    """transformers' greedy continuation with ``token_type_ids`` (image tokens 1), as its processor gives."""
    model, _, _ = _hf(str(model_dir))
    inputs = hf_inputs(model_dir, prompt, images)
    inputs["token_type_ids"] = (inputs["input_ids"] == model.config.image_token_id).long()
    return hf_generate_greedy(model, inputs, MAX_TOKENS)


def params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True)


PROMPTS = [f"{BOI}What is in the picture?", f"Hello {BOI} and {BOI} again", "The quick brown fox"]


def test_pixel_values_equal_transformers(gemma3_vl_dir, images):
    from multimodal.image_processor import load_image_processor
    _, _, proc = _hf(str(gemma3_vl_dir))
    ours = load_image_processor(gemma3_vl_dir)
    for img in images:
        ref = proc([img], return_tensors="pt")["pixel_values"][0]
        assert torch.allclose(ours(img).pixel_values, ref, atol=1e-5), img.size


def test_prompt_expansion_matches_processor(llm, gemma3_vl_dir, images):
    """The model's token-level splice of <start_of_image> equals transformers' text-level replacement."""
    from transformers import AutoConfig

    from engine.models.gemma3_vl import Gemma3ForConditionalGeneration

    _, tok, _ = _hf(str(gemma3_vl_dir))
    model = Gemma3ForConditionalGeneration(AutoConfig.from_pretrained(gemma3_vl_dir), MAX_LEN)
    pp = model.make_prompt_processor(gemma3_vl_dir)
    for prompt, n in zip(PROMPTS[:2], (1, 2), strict=True):
        ref = hf_inputs(gemma3_vl_dir, prompt, [])["input_ids"][0].tolist()
        out, items = pp.process(tok(prompt, add_special_tokens=False)["input_ids"], images[:n])
        assert out == ref, prompt
        assert [it.length for it in items] == [MM_TOKENS] * n
        assert [out[it.offset - 1] for it in items] == [tok.convert_tokens_to_ids(BOI)] * n
        # A prompt already expanded stays as it is.
        again, _ = pp.process(out, images[:n])
        assert again == out


def test_one_image(llm, gemma3_vl_dir, images):
    for img in images[:2]:
        ref = hf_greedy(gemma3_vl_dir, PROMPTS[0], [img])
        out = llm.generate({"prompt": PROMPTS[0], "multi_modal_data": {"image": img}}, params(), use_tqdm=False)
        check_logprobs_close(ref, ours_as_ref(out[0].outputs[0]), f"gemma3 {img.size}")


def test_two_images_and_text_batch(llm, gemma3_vl_dir, images):
    reqs = [({"prompt": PROMPTS[1], "multi_modal_data": {"image": [images[0], images[2]]}}, [images[0], images[2]]),
            ({"prompt": PROMPTS[0], "multi_modal_data": {"image": images[3]}}, [images[3]]),
            ({"prompt": PROMPTS[2]}, [])]
    outs = llm.generate([r for r, _ in reqs], params(), use_tqdm=False)
    for (req, imgs), out in zip(reqs, outs, strict=True):
        ref = hf_greedy(gemma3_vl_dir, req["prompt"], imgs)
        check_logprobs_close(ref, ours_as_ref(out.outputs[0]), req["prompt"])


def test_chunked_prefill_keeps_an_image_whole_and_prefix_caching(gemma3_vl_dir, images):
    """A 6-token budget prefills the prompt over several steps, each image in one chunk (no chunk ends inside
    its 4 tokens); the second request shares the image prefix from the cache (a block of 4 tokens: the hit may
    end inside the image, whose cached tokens saw all of it); both equal transformers."""
    prompt = "Some words first " + PROMPTS[0]
    llm = LLM(str(gemma3_vl_dir), device="cpu", dtype="float32", max_num_seqs=4, max_model_len=MAX_LEN,
              enable_prefix_caching=True, max_num_batched_tokens=6, block_size=4)
    sched = llm.llm_engine.core.scheduler
    assert sched.whole_media_chunks
    chunk_ends = []
    real_schedule = sched.schedule

    def schedule():
        so = real_schedule()        # advances each scheduled request's num_computed_tokens to its chunk's end
        chunk_ends.extend((r.num_computed_tokens, r.mm_features) for r in sched.running
                          if r.mm_features and so.num_scheduled_tokens.get(r.request_id))
        return so

    sched.schedule = schedule
    first = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images[1]}}, params(), use_tqdm=False)
    second = llm.generate({"prompt": prompt + " again", "multi_modal_data": {"image": images[1]}}, params(),
                          use_tqdm=False)
    for p, out in ((prompt, first), (prompt + " again", second)):
        check_logprobs_close(hf_greedy(gemma3_vl_dir, p, [images[1]]), ours_as_ref(out[0].outputs[0]), p)
    assert second[0].num_cached_tokens >= 16
    assert len(chunk_ends) > 6
    for end, features in chunk_ends:    # outside every image
        for f in features:
            assert not f.placeholder.offset < end < f.placeholder.offset + f.placeholder.length


def test_graph_path_with_images_equals_transformers(gemma3_vl_dir, images):
    """Mixed CUDA-graph steps (replayed eagerly on CPU: padded tokens and zero-token requests, the captured
    metadata) fill the image key limits too; decode steps take decode graphs."""
    from tests.models.utils import EagerReplayGraphs

    llm = LLM(str(gemma3_vl_dir), device="cpu", dtype="float32", max_num_seqs=4, max_model_len=MAX_LEN,
              max_num_batched_tokens=40)
    runner = llm.llm_engine.runner
    runner.buffers.enable_media(40, runner.model.shape.hidden_size, runner.dtype, False)
    graphs = EagerReplayGraphs.install(llm, token_sizes=[16, 24, 40])
    reqs = [({"prompt": PROMPTS[0], "multi_modal_data": {"image": images[0]}}, [images[0]]),
            ({"prompt": PROMPTS[1], "multi_modal_data": {"image": images[1:3]}}, images[1:3])]
    outs = llm.generate([r for r, _ in reqs], params(), use_tqdm=False)
    for (req, imgs), out in zip(reqs, outs, strict=True):
        check_logprobs_close(hf_greedy(gemma3_vl_dir, req["prompt"], imgs), ours_as_ref(out.outputs[0]), req["prompt"])
    assert graphs.num_mixed_replays > 0 and graphs.num_replays > graphs.num_mixed_replays


def test_tensor_parallel_2_equals_transformers(gemma3_vl_dir, images):
    """TP 2 (gloo, float32): the language model sharded, the tower and projector whole on each rank."""
    llm = LLM(str(gemma3_vl_dir), tensor_parallel_size=2, device="cpu", dtype="float32", max_model_len=MAX_LEN,
              seed=0)
    try:
        out = llm.generate({"prompt": PROMPTS[1], "multi_modal_data": {"image": images[:2]}}, params(),
                           use_tqdm=False)
    finally:
        llm.llm_engine.core.shutdown()
    check_logprobs_close(hf_greedy(gemma3_vl_dir, PROMPTS[1], images[:2]), ours_as_ref(out[0].outputs[0]), "tp2")


def test_transformers_4_layout_loads(tmp_path, gemma3_vl_dir, images):
    """The 4.x tensor names (language_model.model.*, vision_tower.*, multi_modal_projector.*) give the same
    output as the 5.x checkpoint."""
    import shutil

    from tests.vision.conftest import _rename_tensors
    d = tmp_path / "legacy"
    shutil.copytree(gemma3_vl_dir, d)
    _rename_tensors(d, [("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                        ("model.vision_tower.", "vision_tower."),
                        ("model.multi_modal_projector.", "multi_modal_projector.")])
    llm = LLM(str(d), device="cpu", dtype="float32", max_num_seqs=2, max_model_len=MAX_LEN)
    out = llm.generate({"prompt": PROMPTS[0], "multi_modal_data": {"image": images[2]}}, params(), use_tqdm=False)
    check_logprobs_close(hf_greedy(gemma3_vl_dir, PROMPTS[0], [images[2]]), ours_as_ref(out[0].outputs[0]),
                         "4.x layout")


def test_bidirectional_attention_is_transformers_processor_path(llm, gemma3_vl_dir, images):
    """transformers with token_type_ids (its processor's path) attends bidirectionally within an image:
    Chorus matches it (to float32 rounding), and not the causal path (transformers without token_type_ids)."""
    model, _, _ = _hf(str(gemma3_vl_dir))
    inputs = hf_inputs(gemma3_vl_dir, PROMPTS[0], [images[0]])
    with torch.no_grad():
        causal = torch.log_softmax(model(**inputs).logits[0, -1], -1)
        tt = (inputs["input_ids"] == model.config.image_token_id).long()
        bidir = torch.log_softmax(model(**inputs, token_type_ids=tt).logits[0, -1], -1)
    out = llm.generate({"prompt": PROMPTS[0], "multi_modal_data": {"image": images[0]}},
                       SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, ignore_eos=True), use_tqdm=False)
    ours = out[0].outputs[0].logprobs[0]
    ours_gap = max(abs(lp.logprob - float(bidir[t])) for t, lp in ours.items())
    causal_gap = max(abs(lp.logprob - float(causal[t])) for t, lp in ours.items())
    assert ours_gap < 1e-5, ours_gap
    assert causal_gap > 10 * max(ours_gap, 1e-6), (causal_gap, ours_gap)


def test_chat_completions_with_image(gemma3_vl_dir, images):
    """/v1/chat/completions with a data-URL image: the reply is transformers' greedy continuation of the
    rendered prompt with that image."""
    import base64
    import io

    import httpx

    from tests.server.conftest import start_server

    buf = io.BytesIO()
    images[0].save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    _, tok, _ = _hf(str(gemma3_vl_dir))
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                {"type": "text", "text": "What is it?"}]}],
                                   tokenize=False, add_generation_prompt=True)
    assert text.count(BOI) == 1
    # The PNG round trip is lossless: the reference sees the same pixels.
    from PIL import Image
    decoded = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    ref = hf_greedy(gemma3_vl_dir, text, [decoded])
    srv = start_server(str(gemma3_vl_dir), served_model_name=["tiny-gemma3"], dtype="float32", device="cpu",
                       max_num_seqs=4)
    try:
        body = {"model": "tiny-gemma3", "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": "What is it?"}]}]}
        r = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        reply = r.json()["choices"][0]["message"]["content"]
        assert r.json()["usage"]["prompt_tokens"] == len(hf_inputs(gemma3_vl_dir, text, [])["input_ids"][0])
    finally:
        srv.stop()
    assert reply == tok.decode(ref.token_ids, skip_special_tokens=True)
