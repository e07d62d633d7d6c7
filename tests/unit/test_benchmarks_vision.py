"""benchmarks/vision.py's own pieces: the vision tower's analytic FLOPs against PyTorch's FLOP counter,
the encoder-cache workload, the no-cache salting, and the arrival-driven engine loop on a tiny LLaVA
(CPU, float32)."""

from __future__ import annotations

import argparse
import contextlib
import random
import time

import pytest
import torch

from benchmarks import vision


def test_vision_flops_equal_the_flop_counter_on_the_tower():
    """Every matmul of Qwen2-VL's tower, attention per frame included (SDPA's math path is bmm),
    counted by torch.utils.flop_counter, equals the analytic count; a 2-frame grid attends per frame."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from encoders.qwen2_vl import Qwen2VLVisionTransformer

    vc = vision.build_config(vision.QWEN2_VL_TINY, "float32").vision_config
    tower = Qwen2VLVisionTransformer(vc).eval()
    grids = [(1, 4, 6), (2, 4, 4), (1, 8, 8)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = tower(pixels, torch.tensor(grids))
    assert out.shape == (sum(t * h * w for t, h, w in grids) // 4, vc.hidden_size)
    assert counter.get_total_flops() == vision.vision_flops(grids, vc)
    # The full-size shape: one 448x448 image (32x32 patches) is ~1.49 TFLOP, attention ~12% of it.
    full = vision.build_config(vision.QWEN2_VL_7B, "bfloat16").vision_config
    total = vision.vision_flops([(1, 32, 32)], full)
    attention = 32 * 4 * 1024 ** 2 * 1280
    assert 1.48e12 < total < 1.49e12 and 0.11 < attention / total < 0.12


def test_cache_workload_shares_exactly_the_popular_fraction():
    choice = vision.cache_image_choice(400, 20, 0.8, seed=2)
    shared = [i for i in choice if i < 20]
    unique = [i for i in choice if i >= 20]
    assert len(shared) == 320 and len(set(shared)) == 20
    assert sorted(unique) == list(range(20, 100))
    assert choice == vision.cache_image_choice(400, 20, 0.8, seed=2)
    assert choice != vision.cache_image_choice(400, 20, 0.8, seed=3)


def test_cache_prompts_put_the_varying_text_before_the_image():
    shape = vision.LLAVA_15_7B
    images = vision.distinct_images(2, (40, 30), seed=0)
    prompts = vision.cache_prompts(shape, [0, 0, 1], images, 64, seed=0)
    ids = [p["prompt_token_ids"] for p in prompts]
    at = [x.index(shape.image_token_id) for x in ids]
    assert at == [65, 65, 65]                                   # BOS + 64 varying tokens
    assert len({tuple(x[:65]) for x in ids}) == 3               # no prefix shared up to the image
    assert ids[0][66:] == ids[1][66:] == ids[2][66:]            # the same question after it
    assert prompts[0]["multi_modal_data"]["image"] is prompts[1]["multi_modal_data"]["image"]
    assert all(3 <= t < 32000 for x in ids for t in x[1:] if t != shape.image_token_id)


def test_distinct_images_and_salted_hashes():
    from multimodal.image_processor import image_processor_from_config
    from multimodal.processing import LlavaPromptProcessor

    images = vision.distinct_images(5, (64, 48), seed=1)
    assert all(img.size == (64, 48) and img.mode == "RGB" for img in images)
    assert len({img.tobytes() for img in images}) == 5
    processor = LlavaPromptProcessor(image_processor_from_config(vision.LLAVA_TINY.image_processor), 500, 16)

    def identifier(img):
        return processor.process([1, 500, 7], [img])[1][0].identifier

    plain = identifier(images[0])
    assert identifier(images[0]) == plain != identifier(images[1])
    with vision.salted_image_hashes():
        salted = [identifier(images[0]) for _ in range(3)]
    assert len(set(salted)) == 3 and all(s.startswith(plain) and s != plain for s in salted)
    assert identifier(images[0]) == plain                       # restored


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("TMPDIR", str(tmp_path_factory.mktemp("vision-bench")))
    args = argparse.Namespace(tiny=True, max_model_len=256, enforce_eager=False, gpu_memory_utilization=0.9,
                              encoder_cache_size=None)
    yield vision.build_llm(args, vision.LLAVA_TINY)
    mp.undo()


@pytest.mark.parametrize("mode", ["with", "without"])
def test_driven_run_encodes_each_image_once_only_with_the_cache(tiny_llava, mode):
    """Six requests over two images, staggered: with the cache two encodes and four hits; salted,
    six encodes and no hit. Every request finishes with its tokens and a TTFT from its arrival."""
    engine = tiny_llava.llm_engine
    vision.clear_caches(engine)
    images = vision.distinct_images(2, (40, 30), seed=7)
    prompts = vision.cache_prompts(vision.LLAVA_TINY, [0, 1, 0, 1, 0, 0], images, 8, seed=7)
    with vision.salted_image_hashes() if mode == "without" else contextlib.nullcontext():
        staged = vision.stage(engine, prompts, 3, [0.0] * 6, "image", f"t-{mode}")
    staged = vision.restage(staged, vision.even_arrivals(6, 100.0), f"t-{mode}-run")
    stats0, encoded0 = engine.get_stats(), engine.runner.num_encoded_items
    t0 = time.time()
    rows, added = vision.drive(engine, staged)
    stats = engine.get_stats()
    assert added == {"image": 6} and len(rows) == 6
    assert all(r["output_tokens"] == 3 and r["ttft_s"] >= 0 and r["tpot_s"] >= 0 for r in rows.values())
    assert max(r["finished_s"] for r in rows.values()) <= time.time() - t0
    assert engine.runner.num_encoded_items - encoded0 == (2 if mode == "with" else 6)
    assert stats.encoder_cache_queries - stats0.encoder_cache_queries == 6
    assert stats.encoder_cache_hits - stats0.encoder_cache_hits == (4 if mode == "with" else 0)
    summary = vision.summarize_run(rows)
    assert summary["requests"] == 6 and summary["output_tokens"] == 18 and summary["ttft_p50_ms"] >= 0


def test_drive_stops_the_background_stream_when_the_watched_kind_is_done(tiny_llava):
    engine = tiny_llava.llm_engine
    vision.clear_caches(engine)
    shape = vision.LLAVA_TINY
    text = [{"prompt_token_ids": [1] + vision.text_ids(random.Random(0), 20, shape)} for _ in range(2)]
    staged = vision.stage(engine, text, 4, [0.0, 0.0], "text", "w-t")
    images = vision.one_image_prompts(shape, vision.distinct_images(200, (40, 30), seed=8), 8, seed=8)
    # The first image arrives with the text (at 0 s), so the stream has started before the text can finish.
    staged += vision.stage(engine, images, 50, vision.even_arrivals(200, 50.0, 0.0), "image", "w-i")
    rows, added = vision.drive(engine, staged, stop_when_done="text")
    assert {rid for rid, r in rows.items() if r["kind"] == "text"} == {"w-t-0", "w-t-1"}
    assert 0 < added["image"] < 200                             # the stream ran, and stopped with the text
    assert not engine.has_unfinished_requests()
    assert vision.summarize_run(rows, "text")["requests"] == 2
