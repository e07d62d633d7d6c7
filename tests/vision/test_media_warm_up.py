"""The media warm-up (``engine.runner.warm_up.warm_up_media``, run at start-up on CUDA), called explicitly on
CPU on the tiny LLaVA, Qwen2-VL, Gemma 3, Whisper and Qwen2-Audio: each model's declared items are encoded (and
prefilled where the prompt fits a step), nothing is held afterwards (runner rows, encoder cache, sampled ids,
the scheduler's block pool and encoder cache), and a request after the warm-up gives the tokens and logprobs
of the same request on an engine that never warmed up."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.audio.conftest import qwen2_audio_dir, tiny_random_whisper_dir  # noqa: F401
from tests.audio.whisper_reference import load_wav
from tests.vision.test_gemma3_vl import BOI, build_tiny_gemma3_vl


@pytest.fixture(scope="module")
def gemma3_vl_dir(tmp_path_factory):
    return build_tiny_gemma3_vl(tmp_path_factory.mktemp("tiny-gemma3-vl"))


def _held(llm: LLM) -> dict:
    """Everything a request holds while it runs, as counts."""
    core = llm.llm_engine.core
    runner, sched = core.runner, core.scheduler
    return {"runner requests": len(runner.states.requests), "encoder outputs": len(runner.encoder_cache),
            "encoded items": runner.num_encoded_items,
            "free blocks": sched.kv_cache_manager.block_pool.num_free_blocks,
            "encoder cache free slots": sched.encoder_cache_manager.num_free_slots,
            "encoder cache entries": len(sched.encoder_cache_manager.cached)}


def _request(name: str, images) -> dict:
    if name == "llava":
        return {"prompt": "<image>\nWhat is in the picture?", "multi_modal_data": {"image": images[0]}}
    if name == "qwen2_vl":
        return {"prompt": "<|vision_start|><|image_pad|><|vision_end|>What is it?",
                "multi_modal_data": {"image": images[1]}}
    if name == "gemma3":
        return {"prompt": f"{BOI}What is in the picture?", "multi_modal_data": {"image": images[2]}}
    if name == "qwen2_audio":
        return {"prompt": "<|audio_bos|><|AUDIO|><|audio_eos|>What is said?",
                "multi_modal_data": {"audio": (load_wav("hello")[0], 16000)}}
    return {"prompt_token_ids": None, "multi_modal_data": {"audio": (load_wav("fox")[0], 16000)}}


@pytest.mark.parametrize("name,fixture,expected_items", [
    ("llava", "tiny_llava_dir", 1),
    ("qwen2_vl", "tiny_qwen2_vl_dir", 2),
    ("gemma3", "gemma3_vl_dir", 1),
    ("whisper", "tiny_random_whisper_dir", 1),
    ("qwen2_audio", "qwen2_audio_dir", 1),
])
def test_warm_up_holds_nothing_and_changes_no_output(name, fixture, expected_items, request, images):
    model_dir = str(request.getfixturevalue(fixture))
    kw = dict(device="cpu", dtype="float32", max_num_seqs=4, max_model_len=1024, max_num_batched_tokens=1024)
    if name == "whisper":
        kw.pop("max_model_len")
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    cold = LLM(model_dir, **kw)
    prompt = _request(name, images)
    if name == "whisper":
        ids = cold.llm_engine.processor.transcriber.ids
        prompt["prompt_token_ids"] = [ids.sot, ids.no_timestamps]
    want = cold.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    cold.close()

    llm = LLM(model_dir, **kw)
    runner = llm.llm_engine.core.runner
    declared = runner.model.media_warm_up()
    assert len(declared) == expected_items
    before = _held(llm)
    num_encoded = []
    encode = runner.media.encode
    runner.media.encode = lambda scheduled, requests: num_encoded.append(encode(scheduled, requests)) or num_encoded[-1]
    assert runner.warm_up_media() == expected_items
    runner.media.encode = encode
    # every declared item went through the encoder, then the first one with placeholders filled one call
    first = next((it for it in declared if it.placeholder_offset is not None), None)
    full = min(runner.encoder_compute_budget // first.num_embeds, 4) if first is not None else 0
    assert num_encoded == [1] * expected_items + ([full] if full > 1 else [])
    assert (full > 1) == (name in ("llava", "qwen2_vl", "gemma3"))
    assert _held(llm) == before
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert list(got.token_ids) == list(want.token_ids)
    ours = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
    theirs = [step[t].logprob for step, t in zip(want.logprobs, want.token_ids)]
    np.testing.assert_allclose(ours, theirs, atol=1e-6, rtol=0)
    llm.close()


def test_an_item_over_the_encoder_budget_is_skipped(tiny_llava_dir):
    """An encoder budget below the image's embeddings: the warm-up runs nothing (the scheduler would refuse
    such an item too), and holds nothing."""
    llm = LLM(str(tiny_llava_dir), device="cpu", dtype="float32", max_model_len=256)
    runner = llm.llm_engine.core.runner
    runner.encoder_compute_budget = runner.model.media_warm_up()[0].num_embeds - 1
    before = _held(llm)
    assert runner.warm_up_media() == 0
    assert _held(llm) == before
    llm.close()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,fixture", [("llava", "tiny_llava_dir"), ("qwen2_vl", "tiny_qwen2_vl_dir"),
                                          ("whisper", "tiny_random_whisper_dir")])
def test_start_up_on_cuda_warms_up_and_holds_nothing(name, fixture, request, images):
    """On CUDA the engine warms the media paths itself at start-up (one log line), with its CUDA graphs
    captured; afterwards nothing is held and a request runs."""
    lines = _Lines()
    logger = logging.getLogger("chorus.runner")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(lines)
    try:
        kw = dict(device="cuda", dtype="float32", max_num_seqs=4, gpu_memory_utilization=0.3)
        if name != "whisper":
            kw.update(max_model_len=1024, max_num_batched_tokens=1024)
        llm = LLM(str(request.getfixturevalue(fixture)), **kw)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    assert any(line.startswith("Media paths warmed up") for line in lines.lines)
    held = _held(llm)
    assert held["runner requests"] == held["encoder outputs"] == held["encoded items"] == 0
    assert held["encoder cache entries"] == 0
    prompt = _request(name, images)
    if name == "whisper":
        ids = llm.llm_engine.processor.transcriber.ids
        prompt["prompt_token_ids"] = [ids.sot, ids.no_timestamps]
    out = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    llm.close()
