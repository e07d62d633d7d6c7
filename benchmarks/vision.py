"""Vision-language serving: LLaVA-1.5 and Qwen2-VL throughput, the encoder cache, text TPOT under image load.

Examples:
    # H200, every sub-benchmark at full scale (LLaVA-1.5-7B and Qwen2-VL-7B shapes, random bf16 weights)
    python benchmarks/vision.py all --out benchmarks/results/vision.json
    # one sub-benchmark, fewer requests
    python benchmarks/vision.py llava --num-requests 200 --hf-requests 32
    # CPU check of the whole script: tiny shapes, a handful of requests, float32
    python benchmarks/vision.py all --tiny
    # the towers alone (CLIP-L/336, Qwen2-VL-7B on mixed sizes): TFLOP/s and fraction of peak; --tiny on CPU
    python benchmarks/vision.py towers

Sub-benchmarks (each prints a table; all of them go into one JSON, rewritten after each one):
  llava          LLaVA-1.5-7B shape (CLIP ViT-L/14-336, 576 image tokens, Llama-2-7B). Requests of one
                 distinct random image + ~64 text tokens, fixed output length, greedy, EOS ignored, all at
                 once through ``LLM.generate``; the time ``LLM.generate`` spends in the processor (load,
                 preprocess, hash, expand placeholders) is reported on its own. transformers runs
                 ``LlavaForConditionalGeneration.generate`` (random weights of the same shapes, left padding,
                 batches of ``--hf-batch-size``) on the first ``--hf-requests`` of the same requests; its
                 image processor's time is reported on its own too. Ratios: end to end and generation only.
  encoder-cache  Same shape. 80% of requests use one of 20 images, 20% a unique one; each prompt's varying
                 text comes before its image, so the prefix cache cannot serve the image tokens. Runs with
                 the encoder cache, and without it: every request's images get a request-unique identifier
                 (``multimodal.processing.hash_image`` wrapped with a salt while preparing the requests).
                 Each mode runs a burst (all requests at once: throughput, TTFT) and a paced run (requests
                 spaced evenly at a rate under the no-cache burst's: TTFT). Requests are prepared before the
                 timed run and added at their arrival times between engine steps (``LLMEngine``); TTFT is
                 from the arrival time to the first token. Prints the engine's encoder-cache hit rate
                 (``SchedulerStats``) and ``runner.num_encoded_items`` per run.
  text-tpot      Text requests (256-token prompts, 256 new tokens) alone, then the same requests with
                 LLaVA image requests arriving at a steady rate until they finish: the text requests'
                 TPOT p50 / p90 in both runs (TPOT = (last token time - first token time) / (tokens - 1)).
  qwen2-vl       Qwen2-VL-7B shape, images of mixed sizes (448x448 to 1344x896, 256 to 1536 tokens):
                 ``LLM.generate`` throughput, then ``model.visual`` alone on batches of those images (CUDA
                 events after a warm-up) against its FLOPs counted analytically (``vision_flops``), as
                 TFLOP/s and a fraction of the H200's dense bf16 peak.
  towers         The vision towers alone, random weights, no engine: CLIP ViT-L/14-336 as LLaVA-1.5 runs it
                 (23 of 24 layers: feature layer -2) on batches of images, and the Qwen2-VL-7B tower on
                 calls that pack one image of each mixed size (448x448 to 1344x896) several times over;
                 device time per call (CUDA events after a warm-up) against the FLOPs counted analytically
                 (``vit_flops``, ``vision_flops``), as TFLOP/s and a fraction of the H200's dense bf16 peak.
  all            The first four above, in this order; the LLaVA engine is built once and shared by llava,
                 encoder-cache and text-tpot (transformers runs before it is built).

Image preprocessing throughput by worker threads / processes is benchmarks/preprocess.py's.

Weights are random (``load_format="dummy"``); the checkpoint directories hold a config, an image
processor config and a word-level tokenizer with one token per id (the prompts are token ids; every
sampled id detokenizes), written under $TMPDIR (default /tmp).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from benchmarks.throughput import alloc_retries, print_steps_by_kind  # noqa: E402
from multimodal.image_processor import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0
HF_REFERENCE_TOK_S = 334.5
"""transformers 5.17 ``generate`` at batch 32 on an H200, LLaVA-1.5-7B shape (the issue's number)."""
SUB_BENCHMARKS = ("llava", "encoder-cache", "text-tpot", "qwen2-vl")
"""What ``all`` runs; ``towers`` runs on its own."""


# ----------------------------------------------------------------------------------------
# Shapes and scales
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VLShape:
    """A vision-language checkpoint's shape and its special token ids."""

    name: str
    vision: dict
    text: dict
    image_token_id: int
    bos_id: int
    eos_id: int
    pad_id: int
    specials: dict
    """token id -> its text, for the tokenizer (every other id i is the word ``t{i}``)."""
    image_processor: dict
    """preprocessor_config.json."""


LLAVA_SPECIALS = {0: "<unk>", 1: "<s>", 2: "</s>", 32000: "<image>", 32001: "<pad>"}
LLAVA_15_7B = VLShape(
    name="llava-1.5-7b",
    vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                image_size=336, patch_size=14, hidden_act="quick_gelu", projection_dim=768),
    text=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
              num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096, rms_norm_eps=1e-5,
              tie_word_embeddings=False),
    image_token_id=32000, bos_id=1, eos_id=2, pad_id=32001, specials=LLAVA_SPECIALS,
    image_processor=dict(image_processor_type="CLIPImageProcessor", size={"shortest_edge": 336},
                         crop_size={"height": 336, "width": 336}, do_center_crop=True, resample=3,
                         do_rescale=True, rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True,
                         image_mean=list(OPENAI_CLIP_MEAN), image_std=list(OPENAI_CLIP_STD)))
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
"""The tiny language models' sizes (the rest as the full shape's)."""
LLAVA_TINY = replace(
    LLAVA_15_7B, name="llava-tiny",
    vision={**LLAVA_15_7B.vision, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "image_size": 56, "projection_dim": 32},
    text={**LLAVA_15_7B.text, **TINY_TEXT},
    image_token_id=500, pad_id=501, specials={0: "<unk>", 1: "<s>", 2: "</s>", 500: "<image>", 501: "<pad>"},
    image_processor={**LLAVA_15_7B.image_processor, "size": {"shortest_edge": 56},
                     "crop_size": {"height": 56, "width": 56}})

QWEN_SPECIALS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>",
                 151652: "<|vision_start|>", 151653: "<|vision_end|>", 151655: "<|image_pad|>"}
QWEN2_VL_7B = VLShape(
    name="qwen2-vl-7b",
    vision=dict(depth=32, embed_dim=1280, hidden_size=3584, num_heads=16, mlp_ratio=4, patch_size=14,
                temporal_patch_size=2, spatial_merge_size=2, in_channels=3),
    text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
              num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6,
              tie_word_embeddings=False,
              rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24])),
    image_token_id=151655, bos_id=151644, eos_id=151645, pad_id=151643, specials=QWEN_SPECIALS,
    image_processor=dict(image_processor_type="Qwen2VLImageProcessor", min_pixels=56 * 56,
                         max_pixels=1344 * 896, patch_size=14, temporal_patch_size=2, merge_size=2,
                         image_mean=list(OPENAI_CLIP_MEAN), image_std=list(OPENAI_CLIP_STD)))
QWEN2_VL_TINY = replace(
    QWEN2_VL_7B, name="qwen2-vl-tiny",
    vision={**QWEN2_VL_7B.vision, "depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 4,
            "mlp_ratio": 2},
    text={**QWEN2_VL_7B.text, **TINY_TEXT,
          "rope_parameters": dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 3, 3])},
    image_token_id=505, bos_id=501, eos_id=502, pad_id=500,
    specials={500: "<|endoftext|>", 501: "<|im_start|>", 502: "<|im_end|>", 503: "<|vision_start|>",
              504: "<|vision_end|>", 505: "<|image_pad|>"},
    image_processor={**QWEN2_VL_7B.image_processor, "max_pixels": 112 * 84})


@dataclass(frozen=True)
class Scale:
    """Request counts and sizes of a run (FULL: the H200 run; TINY: a CPU check of the script)."""

    llava: VLShape
    qwen: VLShape
    num_requests: int            # llava: requests through LLM.generate
    image_size: tuple[int, int]  # LLaVA images, (width, height)
    text_len: int                # LLaVA prompts: text tokens around the image
    output_len: int              # llava, qwen2-vl, image requests of text-tpot
    hf_requests: int
    hf_batch_size: int
    cache_requests: int
    cache_popular: int           # distinct shared images of encoder-cache
    cache_output_len: int
    qwen_requests: int
    qwen_sizes: tuple[tuple[int, int], ...]
    vision_images: int           # images timed through model.visual
    vision_batch_sizes: tuple[int, ...]
    tower_batch_sizes: tuple[int, ...]  # towers: CLIP images per call
    tower_mixed_repeats: tuple[int, ...]  # towers: Qwen2-VL calls hold this many images of each size
    tpot_text_requests: int
    tpot_prompt_len: int
    tpot_output_len: int
    tpot_image_rate: float       # image requests / s during the text requests
    warmup_requests: int


FULL = Scale(llava=LLAVA_15_7B, qwen=QWEN2_VL_7B, num_requests=1000, image_size=(1024, 768), text_len=64,
             output_len=128, hf_requests=64, hf_batch_size=32, cache_requests=400, cache_popular=20,
             cache_output_len=32, qwen_requests=500,
             qwen_sizes=((448, 448), (672, 504), (896, 672), (1120, 840), (1344, 896)),
             vision_images=40, vision_batch_sizes=(1, 8), tower_batch_sizes=(1, 8, 32, 64),
             tower_mixed_repeats=(1, 4), tpot_text_requests=32, tpot_prompt_len=256,
             tpot_output_len=256, tpot_image_rate=10.0, warmup_requests=8)
TINY = Scale(llava=LLAVA_TINY, qwen=QWEN2_VL_TINY, num_requests=8, image_size=(96, 72), text_len=16,
             output_len=8, hf_requests=4, hf_batch_size=2, cache_requests=20, cache_popular=4,
             cache_output_len=4, qwen_requests=6, qwen_sizes=((56, 56), (84, 56), (112, 84)),
             vision_images=4, vision_batch_sizes=(1, 2), tower_batch_sizes=(1, 2),
             tower_mixed_repeats=(1,), tpot_text_requests=4, tpot_prompt_len=32,
             tpot_output_len=24, tpot_image_rate=20.0, warmup_requests=2)


# ----------------------------------------------------------------------------------------
# Checkpoints (config-only, for load_format="dummy")
# ----------------------------------------------------------------------------------------
def save_tokenizer(shape: VLShape, out_dir: Path) -> None:
    """A word-level tokenizer with one token per id: ``t{i}``, or the special's text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab_size = shape.text["vocab_size"]
    vocab = {shape.specials.get(i, f"t{i}"): i for i in range(vocab_size)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token=shape.specials.get(0, "t0")))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    named = {shape.bos_id, shape.eos_id, shape.pad_id}
    extra = [t for i, t in shape.specials.items() if i not in named and i != 0]
    PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token=shape.specials.get(0, "t0"), bos_token=shape.specials[shape.bos_id],
        eos_token=shape.specials[shape.eos_id], pad_token=shape.specials[shape.pad_id],
        additional_special_tokens=extra).save_pretrained(out_dir)


def build_config(shape: VLShape, dtype: str):
    """transformers' config of ``shape`` (LlavaConfig or Qwen2VLConfig)."""
    ids = dict(bos_token_id=shape.bos_id, eos_token_id=shape.eos_id, pad_token_id=shape.pad_id)
    if "depth" in shape.vision:
        from transformers import Qwen2VLConfig
        tok = {v: k for k, v in shape.specials.items()}
        cfg = Qwen2VLConfig(text_config={**shape.text, **ids}, vision_config=dict(shape.vision),
                            image_token_id=shape.image_token_id,
                            vision_start_token_id=tok["<|vision_start|>"],
                            vision_end_token_id=tok["<|vision_end|>"],
                            architectures=["Qwen2VLForConditionalGeneration"], dtype=dtype)
    else:
        from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
        cfg = LlavaConfig(vision_config=CLIPVisionConfig(**shape.vision),
                          text_config=LlamaConfig(**shape.text, **ids),
                          image_token_id=shape.image_token_id, vision_feature_layer=-2,
                          vision_feature_select_strategy="default", projector_hidden_act="gelu",
                          architectures=["LlavaForConditionalGeneration"], dtype=dtype)
    cfg.eos_token_id = shape.eos_id
    return cfg


def dummy_checkpoint(shape: VLShape, dtype: str) -> Path:
    """``$TMPDIR/chorus-vision-<name>``: config.json, preprocessor_config.json and a tokenizer."""
    out_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"chorus-vision-{shape.name}"
    out_dir.mkdir(parents=True, exist_ok=True)
    build_config(shape, dtype).save_pretrained(out_dir)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(shape.image_processor, indent=2))
    if not (out_dir / "tokenizer.json").is_file():
        save_tokenizer(shape, out_dir)
    return out_dir


# ----------------------------------------------------------------------------------------
# Workloads
# ----------------------------------------------------------------------------------------
def distinct_images(n: int, size: tuple[int, int], seed: int) -> list[Image.Image]:
    """``n`` RGB images of ``size`` (width, height), each of its own random pixels."""
    rng = np.random.default_rng(seed)
    width, height = size
    return [Image.frombytes("RGB", (width, height), rng.bytes(width * height * 3)) for _ in range(n)]


def text_ids(rng: random.Random, n: int, shape: VLShape) -> list[int]:
    """``n`` random word ids (none of them special)."""
    hi = min((i for i in shape.specials if i > 2), default=shape.text["vocab_size"])
    return [rng.randrange(3, hi) for _ in range(n)]


def image_prompt(shape: VLShape, before: list[int], after: list[int]) -> list[int]:
    """BOS, ``before``, one image placeholder (the engine expands it), ``after``; Qwen2-VL wraps the
    placeholder in its vision start / end tokens."""
    image = [shape.image_token_id]
    if "depth" in shape.vision:
        tok = {v: k for k, v in shape.specials.items()}
        image = [tok["<|vision_start|>"], shape.image_token_id, tok["<|vision_end|>"]]
    return [shape.bos_id] + before + image + after


def one_image_prompts(shape: VLShape, images: list[Image.Image], text_len: int,
                      seed: int) -> list[dict]:
    """One request per image: a short fixed head, the image, then ``text_len - 4`` random tokens."""
    rng = random.Random(seed)
    head = text_ids(random.Random(-1), 4, shape)
    return [{"prompt_token_ids": image_prompt(shape, head, text_ids(rng, text_len - 4, shape)),
             "multi_modal_data": {"image": img}} for img in images]


def cache_image_choice(n: int, num_popular: int, popular_fraction: float, seed: int) -> list[int]:
    """Image index of each of ``n`` requests: exactly round(n * popular_fraction) of them draw one of
    images 0..num_popular-1; every other request gets an index of its own (num_popular, num_popular + 1,
    ...)."""
    rng = random.Random(seed)
    num_shared = round(n * popular_fraction)
    shared = [True] * num_shared + [False] * (n - num_shared)
    rng.shuffle(shared)
    out, next_unique = [], num_popular
    for s in shared:
        if s:
            out.append(rng.randrange(num_popular))
        else:
            out.append(next_unique)
            next_unique += 1
    return out


def cache_prompts(shape: VLShape, choice: list[int], images: list[Image.Image], text_len: int,
                  seed: int) -> list[dict]:
    """The encoder-cache requests: ``text_len`` random tokens (different per request) BEFORE the image,
    so no two requests share a prefix up to it, then one fixed 16-token question."""
    rng = random.Random(seed)
    question = text_ids(random.Random(-2), 16, shape)
    return [{"prompt_token_ids": image_prompt(shape, text_ids(rng, text_len, shape), question),
             "multi_modal_data": {"image": images[i]}} for i in choice]


def even_arrivals(n: int, rate: float, start_s: float = 0.0) -> list[float]:
    """Arrival times (s) of ``n`` requests, 1 / ``rate`` apart from ``start_s`` (inf: all at ``start_s``)."""
    if math.isinf(rate):
        return [start_s] * n
    return [start_s + i / rate for i in range(n)]


@contextlib.contextmanager
def salted_image_hashes() -> Iterator[None]:
    """While active, every image the prompt processors hash gets an identifier of its own (the image's
    hash + a counter): nothing the encoder produced can be reused, which is the engine without its
    encoder cache."""
    import multimodal.processing as processing
    original = processing.hash_image
    counter = itertools.count()

    def salted(image, settings_key: str) -> str:
        return f"{original(image, settings_key)}-nocache{next(counter)}"

    processing.hash_image = salted
    try:
        yield
    finally:
        processing.hash_image = original


# ----------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------
def vision_flops(grids: list[tuple[int, int, int]], vision_config) -> float:
    """Multiply-add FLOPs (2 per MAC) of Qwen2-VL's vision tower on images of these (t, h, w) patch grids:
    patch embedding, per block qkv / proj / fc1 / fc2 (2*M*N*K each) and attention within each frame
    (QK^T and PV: 4 * S^2 * D per frame of S patches), and the patch merger's two matmuls."""
    vc = vision_config
    d = vc.embed_dim
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    hidden = int(d * vc.mlp_ratio)
    m = sum(t * h * w for t, h, w in grids)                             # patches
    flops = 2 * m * patch_dim * d                                       # patch embedding
    per_block = 2 * m * d * (3 * d) + 2 * m * d * d + 2 * (2 * m * d * hidden)
    attention = sum(t * 4 * (h * w) ** 2 * d for t, h, w in grids)
    flops += vc.depth * (per_block + attention)
    merged, merged_dim = m // vc.spatial_merge_size ** 2, d * vc.spatial_merge_size ** 2
    flops += 2 * merged * merged_dim * merged_dim + 2 * merged * merged_dim * vc.hidden_size
    return float(flops)


def vit_flops(num_images: int, vision: dict, num_layers: int) -> float:
    """Multiply-add FLOPs (2 per MAC) of a CLIP ViT tower (``vision``: a CLIPVisionConfig's fields) running
    ``num_layers`` layers on ``num_images`` images: the patch embedding, per layer q/k/v / out / fc1 / fc2
    over the class token + patches, and attention over them (QK^T and PV: 4 * S^2 * D per image)."""
    d, ffn = vision["hidden_size"], vision["intermediate_size"]
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    seq = patches + 1                                                    # the class token
    flops = 2 * num_images * patches * (3 * vision["patch_size"] ** 2) * d
    per_layer = 2 * seq * d * (4 * d) + 2 * (2 * seq * d * ffn) + 4 * seq ** 2 * d
    return float(flops + num_images * num_layers * per_layer)


# ----------------------------------------------------------------------------------------
# Measuring helpers
# ----------------------------------------------------------------------------------------
def seconds_per_pass(one_pass: Callable[[], None], iters: int = 3) -> float:
    """Seconds of one ``one_pass()`` after one warm-up pass, averaged over ``iters``: device time between CUDA
    events on CUDA, wall time on CPU."""
    with torch.inference_mode():
        one_pass()
        sync()
        if cuda():
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                one_pass()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) / 1e3 / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            one_pass()
        return (time.perf_counter() - t0) / iters


def peak_row(flops: float, seconds: float, calls: int) -> dict:
    """ms per call, TFLOP, TFLOP/s and the fraction of the H200's dense bf16 peak of ``calls`` calls that
    did ``flops`` in ``seconds``."""
    return dict(ms_per_call=seconds * 1e3 / calls, tflop=flops / 1e12, tflop_s=flops / seconds / 1e12,
                fraction_of_peak=flops / seconds / 1e12 / H200_BF16_DENSE_TFLOPS)


PEAK_COLUMNS = [("ms_per_call", "ms/call", ".2f"), ("tflop", "TFLOP", ".3f"), ("tflop_s", "TFLOP/s", ".1f"),
                ("fraction_of_peak", "of peak", ".3f")]
"""The columns of ``peak_row``."""
def cuda() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if cuda():
        torch.cuda.synchronize()


class CallTimer:
    """Time spent in ``obj.name(...)`` while installed: wall seconds summed over calls (``span``: from the
    first call's start to the last one's end, for calls made on several threads at once), or with
    ``device`` the device time between CUDA events recorded around each call (no synchronization)."""

    def __init__(self, device: bool = False, span: bool = False) -> None:
        self.device = device
        self.span = span
        self.calls = 0
        self._wall = 0.0
        self._first_start: Optional[float] = None
        self._last_end = 0.0
        self._events: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def install(self, obj: Any, name: str) -> Iterator["CallTimer"]:
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            self.calls += 1
            if self.device:
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = original(*args, **kwargs)
                stop.record()
                self._events.append((start, stop))
                return out
            t0 = time.perf_counter()
            if self._first_start is None or t0 < self._first_start:
                self._first_start = t0
            try:
                return original(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                self._wall += t1 - t0
                self._last_end = max(self._last_end, t1)

        setattr(obj, name, timed)
        try:
            yield self
        finally:
            delattr(obj, name)   # the class's method shows through again

    @property
    def seconds(self) -> float:
        if not self.device:
            if self.span:
                return 0.0 if self._first_start is None else self._last_end - self._first_start
            return self._wall
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in self._events) / 1e3


def encoder_timer(llm_or_engine) -> contextlib.AbstractContextManager:
    """A ``CallTimer`` on the model's ``embed_multimodal`` (device time on CUDA, wall on CPU)."""
    engine = getattr(llm_or_engine, "llm_engine", llm_or_engine)
    return CallTimer(device=cuda()).install(engine.runner.model, "embed_multimodal")


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """Columns: (key, header, format spec); a missing or None value prints as '-'."""
    def cell(r: dict, key: str, fmt: str) -> str:
        v = r.get(key)
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    widths = [max([len(h), 9] + [len(cell(r, k, f)) for r in rows]) for k, h, f in columns]
    for cells in [[h for _, h, _ in columns]] + [[cell(r, k, f) for k, _, f in columns] for r in rows]:
        print(" ".join(f"{c:>{w}s}" if i else f"{c:<{w}s}" for i, (c, w) in enumerate(zip(cells, widths))))


def device_name() -> str:
    return torch.cuda.get_device_name() if cuda() else f"cpu x{torch.get_num_threads()}"


def free_memory() -> None:
    gc.collect()
    if cuda():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------
# Engines
# ----------------------------------------------------------------------------------------
def build_llm(args, shape: VLShape):
    from engine import LLM
    dtype = "float32" if args.tiny else "bfloat16"
    kw: dict[str, Any] = dict(load_format="dummy", dtype=dtype, seed=0, max_model_len=args.max_model_len,
                              enforce_eager=args.enforce_eager,
                              gpu_memory_utilization=args.gpu_memory_utilization)
    if args.tiny:
        kw.update(device="cpu", max_num_seqs=16)
    if args.encoder_cache_size:
        kw["encoder_cache_size"] = args.encoder_cache_size
    t0 = time.perf_counter()
    llm = LLM(str(dummy_checkpoint(shape, dtype)), **kw)
    sc = llm.llm_engine.engine_config.scheduler_config
    ecm = llm.llm_engine.scheduler.encoder_cache_manager
    print(f"{shape.name}: engine ready in {time.perf_counter() - t0:.1f} s (max_num_seqs {sc.max_num_seqs}, "
          f"max_num_batched_tokens {sc.max_num_batched_tokens}, encoder budget "
          f"{llm.llm_engine.scheduler.encoder_compute_budget} / cache {ecm.cache_size} embeddings)",
          flush=True)
    return llm


def sampling(max_tokens: int):
    from engine.sampling_params import RequestOutputKind, SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def warm_up(llm, prompts: list[dict]) -> None:
    """Untimed requests first: kernels compile, the allocator grows; the caches are emptied after."""
    llm.generate(prompts, sampling(4), use_tqdm=False)
    clear_caches(llm.llm_engine)


def clear_caches(engine) -> None:
    """Empty the prefix cache and the encoder cache (unreferenced entries; the runner drops their
    tensors at the next step), so a run reuses nothing from the one before."""
    engine.reset_prefix_cache()
    engine.scheduler.encoder_cache_manager.evict_unreferenced()


GENERATE_COLUMNS = [("system", "system", "s"), ("requests", "requests", "d"), ("seconds", "seconds", ".2f"),
                    ("preprocess_s", "preproc s", ".2f"), ("generate_s", "gen s", ".2f"),
                    ("output_tok_s", "out tok/s", ".1f"), ("output_tok_s_generate", "gen tok/s", ".1f"),
                    ("encoder_s", "encoder s", ".2f"), ("gpu_busy_fraction", "GPU busy", ".3f")]
"""The table of ``generate_timed`` rows: "preproc s" is the processor's time inside the run, "gen s" the
rest, "gen tok/s" output tokens over "gen s", "encoder s" the vision encoder's device time. "GPU busy" is
the ``StepTimer`` step observer's (``benchmarks/step_timer.py``): encoder calls run before a step's timed
interval, so they count as idle."""


def generate_timed(llm, prompts: list[dict], max_tokens: int) -> dict:
    """All ``prompts`` at once through ``LLM.generate``: wall time, processor time, encoder time, steps."""
    engine = llm.llm_engine
    timer = None
    if cuda():
        from benchmarks.step_timer import StepTimer
        timer = engine.runner.step_observer = StepTimer()
    stats0, encoded0, retries0 = engine.get_stats(), engine.runner.num_encoded_items, alloc_retries()
    with CallTimer(span=True).install(engine.processor, "process") as pre, encoder_timer(llm) as enc:
        sync()
        t0 = time.perf_counter()
        res = llm.generate(prompts, sampling(max_tokens), use_tqdm=False)
        sync()
        seconds = time.perf_counter() - t0
    engine.runner.step_observer = None
    busy = timer.summary() if timer is not None else {}
    n_out = sum(len(r.outputs[0].token_ids) for r in res)
    assert n_out == len(prompts) * max_tokens, (n_out, len(prompts), max_tokens)
    stats = engine.get_stats()
    gen_s = seconds - pre.seconds
    return dict(system="chorus", requests=len(prompts), output_tokens=n_out, seconds=seconds,
                preprocess_s=pre.seconds, generate_s=gen_s, output_tok_s=n_out / seconds,
                output_tok_s_generate=n_out / gen_s, req_s=len(prompts) / seconds,
                prompt_tokens=sum(len(r.prompt_token_ids) for r in res),
                encoder_s=enc.seconds, encoder_calls=enc.calls,
                encoded_items=engine.runner.num_encoded_items - encoded0,
                preemptions=stats.num_preemptions - stats0.num_preemptions,
                steps=stats.num_steps - stats0.num_steps, gpu_busy_fraction=busy.get("busy_fraction"),
                steps_by_kind=busy.get("by_kind"),
                alloc_retries=None if retries0 is None else alloc_retries() - retries0)


@dataclass
class Timed:
    """One request of a run driven by ``drive``."""

    request_id: str
    arrival_s: float
    """Seconds after the run's start at which it is added."""
    kind: str
    """'text' or 'image'."""
    text: Optional[str]
    children: list


def stage(engine, prompts: list[dict], max_tokens: int, arrivals: list[float], kind: str,
          prefix: str) -> list[Timed]:
    """Run the processor on every request now (outside the timed run)."""
    out = []
    for i, (prompt, arrival) in enumerate(zip(prompts, arrivals)):
        rid = f"{prefix}-{i}"
        text, children = engine.processor.process(rid, prompt, sampling(max_tokens))
        out.append(Timed(rid, arrival, kind, text, children))
    return out


def restage(staged: list[Timed], arrivals: list[float], prefix: str) -> list[Timed]:
    """The same processed requests under new ids and arrival times (nothing is preprocessed again)."""
    out = []
    for i, (r, arrival) in enumerate(zip(staged, arrivals)):
        rid = f"{prefix}-{i}"
        children = [replace(c, request_id=rid, sampling_params=c.sampling_params.clone()) for c in r.children]
        out.append(Timed(rid, arrival, r.kind, r.text, children))
    return out


def drive(engine, requests: list[Timed],
          stop_when_done: Optional[str] = None) -> tuple[dict[str, dict], dict[str, int]]:
    """Add each request at its arrival time (between steps) and step the engine until all finish;
    with ``stop_when_done=KIND``, stop adding once every request of that kind has finished and abort
    the rest. Returns (per finished request id: kind, ttft_s (arrival -> first token), tpot_s, e2e_s,
    output tokens, finished_s (seconds after the start); requests added, by kind)."""
    order = sorted(requests, key=lambda r: r.arrival_s)
    watch = {r.request_id for r in requests if r.kind == stop_when_done}
    results: dict[str, dict] = {}
    t0 = time.time()
    i = 0
    while True:
        now = time.time()
        while i < len(order) and order[i].arrival_s <= now - t0:
            r = order[i]
            for child in r.children:
                child.arrival_time = t0 + r.arrival_s
            engine.add_processed(r.request_id, r.text, r.children)
            i += 1
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = dict(out=out, done=time.time())
        elif i < len(order):
            time.sleep(max(0.0, order[i].arrival_s - (time.time() - t0)))
        else:
            break
        if watch and watch <= results.keys():
            engine.abort_request([r.request_id for r in order[:i] if r.request_id not in results])
            while engine.has_unfinished_requests():
                engine.step()
            break
    by_id = {r.request_id: r for r in requests}
    rows = {}
    for rid, res in results.items():
        out, r, m = res["out"], by_id[rid], res["out"].metrics
        n = len(out.outputs[0].token_ids)
        arrival = t0 + r.arrival_s
        first, last = m.first_token_time, m.last_token_time
        rows[rid] = dict(kind=r.kind, output_tokens=n, finished_s=res["done"] - t0,
                         ttft_s=None if first is None else first - arrival,
                         tpot_s=(last - first) / (n - 1) if first is not None and n > 1 else None,
                         e2e_s=res["done"] - arrival)
    added: dict[str, int] = {}
    for r in order[:i]:
        added[r.kind] = added.get(r.kind, 0) + 1
    return rows, added


def summarize_run(rows: dict[str, dict], kind: Optional[str] = None) -> dict:
    """Throughput and latency percentiles (ms) of one driven run's finished requests (of ``kind``)."""
    done = [r for r in rows.values() if kind is None or r["kind"] == kind]
    span = max((r["finished_s"] for r in rows.values()), default=float("nan"))
    n_out = sum(r["output_tokens"] for r in done)
    ttft = [r["ttft_s"] * 1e3 for r in done if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] * 1e3 for r in done if r["tpot_s"] is not None]
    return dict(requests=len(done), seconds=span, output_tokens=n_out, output_tok_s=n_out / span,
                req_s=len(done) / span, ttft_p50_ms=pct(ttft, 50), ttft_p90_ms=pct(ttft, 90),
                tpot_p50_ms=pct(tpot, 50), tpot_p90_ms=pct(tpot, 90))


# ----------------------------------------------------------------------------------------
# transformers
# ----------------------------------------------------------------------------------------
def run_hf_vlm(shape: VLShape, prompts: list[dict], output_len: int, batch_size: int, tiny: bool) -> dict:
    """transformers' LLaVA or Qwen2-VL on ``prompts``: its image processor, placeholders expanded as its
    processor does (LLaVA: patches; Qwen2-VL: t * h * w / merge**2 per image, with the mm_token_type_ids
    its M-RoPE needs), left padding, ``generate`` per batch (greedy, exactly ``output_len`` new tokens)."""
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText
    device = "cuda" if cuda() else "cpu"
    dtype = torch.float32 if tiny else torch.bfloat16
    ckpt = dummy_checkpoint(shape, "float32" if tiny else "bfloat16")
    cfg = AutoConfig.from_pretrained(ckpt)
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(cfg, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None
    load_s = time.perf_counter() - t0
    image_processor = AutoImageProcessor.from_pretrained(ckpt)
    vc = cfg.vision_config
    qwen = cfg.model_type != "llava"

    def run_batch(batch: list[dict], new_tokens: int) -> float:
        t = time.perf_counter()
        images = [p["multi_modal_data"]["image"] for p in batch]
        processed = image_processor(images, return_tensors="pt")
        pre = time.perf_counter() - t
        if qwen:   # one image per prompt: its grid's tokens
            counts = [int(t * h * w) // vc.spatial_merge_size ** 2 for t, h, w in processed["image_grid_thw"].tolist()]
        else:      # 'default' strategy: the CLS token dropped
            counts = [(vc.image_size // vc.patch_size) ** 2] * len(batch)
        rows = []
        for p, num_embeds in zip(batch, counts):
            ids = []
            for tid in p["prompt_token_ids"]:
                ids.extend([tid] * num_embeds if tid == shape.image_token_id else [tid])
            rows.append(ids)
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), shape.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(rows):
            ids[j, width - len(r):] = torch.tensor(r)
            mask[j, width - len(r):] = 1
        extra = {}
        if qwen:
            extra = dict(image_grid_thw=processed["image_grid_thw"].to(device),
                         mm_token_type_ids=(ids == shape.image_token_id).int().to(device))
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 pixel_values=processed["pixel_values"].to(device, dtype), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=shape.pad_id, **extra)
        assert out.shape[1] - width == new_tokens, (out.shape, width, new_tokens)
        return pre

    run_batch(prompts[:1], 2)                                     # warm-up (cuBLAS, allocator)
    sync()
    t0 = time.perf_counter()
    pre = sum(run_batch(prompts[i:i + batch_size], output_len) for i in range(0, len(prompts), batch_size))
    sync()
    seconds = time.perf_counter() - t0
    n_out = len(prompts) * output_len
    model = None   # the closure holds the cell: drop the weights before freeing
    free_memory()
    return dict(system=f"transformers generate (bs {batch_size})", requests=len(prompts), output_tokens=n_out,
                seconds=seconds, preprocess_s=pre, generate_s=seconds - pre, output_tok_s=n_out / seconds,
                output_tok_s_generate=n_out / (seconds - pre), req_s=len(prompts) / seconds, load_s=load_s,
                image_processor=type(image_processor).__name__)


def hf_side_by_side(args, s, shape: VLShape, prompts: list[dict]) -> list[dict]:
    """transformers on the first ``--hf-requests`` of ``prompts`` (``run_hf_vlm``), as a one-row list
    ([] with ``--skip-hf``)."""
    if args.skip_hf:
        return []
    k = min(len(prompts), args.hf_requests or s.hf_requests)
    row = run_hf_vlm(shape, prompts[:k], s.output_len, args.hf_batch_size or s.hf_batch_size, args.tiny)
    print(f"transformers: {row['output_tok_s']:.1f} out tok/s ({row['seconds']:.1f} s)", flush=True)
    return [row]


# ----------------------------------------------------------------------------------------
# Sub-benchmarks
# ----------------------------------------------------------------------------------------
class Session:
    """What sub-benchmarks share: the arguments, the scale, and the LLaVA engine (built once)."""

    def __init__(self, args) -> None:
        self.args = args
        self.scale = args.scale
        self._llava = None

    def llava_llm(self):
        if self._llava is None:
            free_memory()
            self._llava = build_llm(self.args, self.scale.llava)
            s = self.scale
            images = distinct_images(s.warmup_requests, s.image_size, seed=99)
            warm = one_image_prompts(s.llava, images, s.text_len, seed=99)
            warm_up(self._llava, warm)
        return self._llava

    def release(self) -> None:
        self._llava = None
        free_memory()


def bench_llava(session: Session) -> dict:
    args, s = session.args, session.scale
    n = args.num_requests or s.num_requests
    t0 = time.perf_counter()
    images = distinct_images(n, s.image_size, seed=1)
    prompts = one_image_prompts(s.llava, images, s.text_len, seed=1)
    print(f"llava: {n} distinct {s.image_size[0]}x{s.image_size[1]} images made in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    rows = hf_side_by_side(args, s, s.llava, prompts)
    llm = session.llava_llm()
    chorus = generate_timed(llm, prompts, s.output_len)
    clear_caches(llm.llm_engine)
    rows.insert(0, chorus)
    hf = rows[1] if len(rows) > 1 else None
    ratios = {}
    if hf is not None:
        ratios = dict(end_to_end=chorus["output_tok_s"] / hf["output_tok_s"],
                      generate_only=chorus["output_tok_s_generate"] / hf["output_tok_s_generate"])
    print(f"\nllava: {n} requests, 1 image ({s.llava.image_processor['crop_size']['height']} px after "
          f"preprocessing) + {s.text_len} text tokens each, {s.output_len} new tokens, {device_name()}")
    print_table(rows, GENERATE_COLUMNS)
    if ratios:
        print(f"Chorus / transformers: {ratios['end_to_end']:.2f}x end to end (both with their image "
              f"preprocessing), {ratios['generate_only']:.2f}x without it (target >= 10x; transformers "
              f"measured {HF_REFERENCE_TOK_S} tok/s at batch 32 on an H200 before)")
    print(f"Chorus: {chorus['encoded_items']} images encoded in {chorus['encoder_calls']} encoder calls, "
          f"{chorus['preemptions']} preemptions, {chorus['steps']} steps")
    print_steps_by_kind(chorus.get("steps_by_kind"))
    return dict(rows=rows, ratios=ratios, num_requests=n, image_size=s.image_size, text_len=s.text_len,
                output_len=s.output_len, hf_reference_tok_s=HF_REFERENCE_TOK_S)


def bench_encoder_cache(session: Session) -> dict:
    args, s = session.args, session.scale
    n = args.cache_requests or s.cache_requests
    if args.cache_model == "qwen2-vl":   # a heavy vision tower: the largest image size of the qwen2-vl run
        session.release()
        shape, image_size = s.qwen, s.qwen_sizes[-1]
        llm = build_llm(args, shape)
        warm_up(llm, one_image_prompts(shape, distinct_images(2, image_size, seed=99), s.text_len, seed=99))
    else:
        shape, image_size = s.llava, s.image_size
        llm = session.llava_llm()
    engine = llm.llm_engine
    choice = cache_image_choice(n, s.cache_popular, 0.8, seed=2)
    images = distinct_images(max(choice) + 1, image_size, seed=2)
    prompts = cache_prompts(shape, choice, images, s.text_len, seed=2)

    prepared, prepare_s = {}, {}
    for mode in ("without", "with"):   # the processor runs once per mode, before any timed run
        t0 = time.perf_counter()
        with salted_image_hashes() if mode == "without" else contextlib.nullcontext():
            prepared[mode] = stage(engine, prompts, s.cache_output_len, [0.0] * n, "image", f"ec-{mode}")
        prepare_s[mode] = time.perf_counter() - t0
    print(f"encoder-cache: requests prepared in {prepare_s['without']:.1f} s (salted) and "
          f"{prepare_s['with']:.1f} s", flush=True)

    def run(mode: str, arrivals: list[float], tag: str) -> dict:
        clear_caches(engine)
        staged = restage(prepared[mode], arrivals, f"ec-{mode}-{tag}")
        stats0, encoded0 = engine.get_stats(), engine.runner.num_encoded_items
        with encoder_timer(llm) as enc:
            rows, _ = drive(engine, staged)
            enc_s = enc.seconds
        stats = engine.get_stats()
        steps = stats.num_steps - stats0.num_steps
        queries = stats.encoder_cache_queries - stats0.encoder_cache_queries
        hits = stats.encoder_cache_hits - stats0.encoder_cache_hits
        out = dict(mode=mode, arrivals=tag, **summarize_run(rows), encoder_s=enc_s,
                   encoded_items=engine.runner.num_encoded_items - encoded0, encoder_cache_queries=queries,
                   encoder_cache_hits=hits, hit_rate=hits / queries if queries else float("nan"), steps=steps)
        print(f"encoder-cache {mode:7s} {tag:5s}: {out['seconds']:.2f} s, {out['req_s']:.2f} req/s, TTFT p50 "
              f"{out['ttft_p50_ms']:.0f} ms, {out['encoded_items']} encoded, hit rate {out['hit_rate']:.3f}",
              flush=True)
        return out

    burst = even_arrivals(n, math.inf)
    rows = [run("without", burst, "burst"), run("with", burst, "burst")]
    rate = args.cache_rate or 0.6 * rows[0]["req_s"]
    paced = even_arrivals(n, rate)
    rows += [run("without", paced, "paced"), run("with", paced, "paced")]
    by = {(r["mode"], r["arrivals"]): r for r in rows}
    summary = dict(
        throughput_ratio=by["with", "burst"]["output_tok_s"] / by["without", "burst"]["output_tok_s"],
        ttft_p50_ratio_burst=by["with", "burst"]["ttft_p50_ms"] / by["without", "burst"]["ttft_p50_ms"],
        ttft_p50_ratio_paced=by["with", "paced"]["ttft_p50_ms"] / by["without", "paced"]["ttft_p50_ms"],
        paced_rate_req_s=rate)
    print(f"\nencoder-cache, {args.cache_model} ({image_size[0]}x{image_size[1]} images): {n} requests "
          f"({s.cache_popular} shared images for 80%, a unique image for 20%; "
          f"{s.text_len} varying tokens before the image, 16 after), {s.cache_output_len} new tokens; "
          f"burst = all at once, paced = {rate:.2f} req/s; encoder cache "
          f"{engine.scheduler.encoder_cache_manager.cache_size} embeddings; {device_name()}")
    print_table(rows, [("mode", "cache", "s"), ("arrivals", "arrivals", "s"), ("seconds", "seconds", ".2f"),
                       ("output_tok_s", "out tok/s", ".1f"), ("req_s", "req/s", ".2f"),
                       ("ttft_p50_ms", "TTFT p50", ".0f"), ("ttft_p90_ms", "TTFT p90", ".0f"),
                       ("encoded_items", "encoded", "d"), ("encoder_s", "encoder s", ".2f"),
                       ("hit_rate", "hit rate", ".3f"), ("steps", "steps", "d")])
    print(f"with / without: throughput {summary['throughput_ratio']:.2f}x (target >= 1.3x), TTFT p50 "
          f"{summary['ttft_p50_ratio_burst']:.2f}x burst, {summary['ttft_p50_ratio_paced']:.2f}x paced "
          "(lower is better)")
    if args.cache_model == "qwen2-vl":
        del llm
        free_memory()
    return dict(rows=rows, summary=summary, model=args.cache_model, image_size=image_size, num_requests=n,
                popular_images=s.cache_popular,
                prepare_s=prepare_s, output_len=s.cache_output_len,
                encoder_cache_size=engine.scheduler.encoder_cache_manager.cache_size)


def bench_text_tpot(session: Session) -> dict:
    args, s = session.args, session.scale
    llm = session.llava_llm()
    engine = llm.llm_engine
    rng = random.Random(3)
    n_text = s.tpot_text_requests
    text = [{"prompt_token_ids": [s.llava.bos_id] + text_ids(rng, s.tpot_prompt_len - 1, s.llava)}
            for _ in range(n_text)]
    rate = args.tpot_image_rate or s.tpot_image_rate

    def run(tag: str, with_images: bool, horizon_s: float) -> dict:
        clear_caches(engine)
        staged = stage(engine, text, s.tpot_output_len, [0.0] * n_text, "text", f"tpot-{tag}-t")
        k = math.ceil(rate * horizon_s) + 1 if with_images else 0
        if k:
            imgs = one_image_prompts(s.llava, distinct_images(k, s.image_size, seed=4), s.text_len, seed=4)
            staged += stage(engine, imgs, s.output_len, even_arrivals(k, rate, 0.5 / rate), "image",
                            f"tpot-{tag}-i")
        rows, added = drive(engine, staged, stop_when_done="text")
        out = dict(run=tag, **summarize_run(rows, "text"), image_requests_added=added.get("image", 0),
                   image_requests_finished=sum(1 for r in rows.values() if r["kind"] == "image"),
                   image_stream_ran_out=bool(k) and added.get("image", 0) == k)
        print(f"text-tpot {tag}: {out['seconds']:.2f} s, TPOT p50 {out['tpot_p50_ms']:.2f} ms", flush=True)
        if out["image_stream_ran_out"]:
            print(f"WARNING: all {k} image requests arrived before the text requests finished: the image "
                  "stream did not last the whole run")
        return out

    alone = run("alone", False, 0.0)
    # Image arrivals are prepared for 8x the text-only run; they stop once the text requests finish.
    mixed = run("images", True, 8 * alone["seconds"] + 1.0)
    ratios = dict(tpot_p50=mixed["tpot_p50_ms"] / alone["tpot_p50_ms"],
                  tpot_p90=mixed["tpot_p90_ms"] / alone["tpot_p90_ms"])
    print(f"\ntext-tpot: {n_text} text requests ({s.tpot_prompt_len}-token prompts, {s.tpot_output_len} new "
          f"tokens) alone, then with LLaVA image requests ({s.text_len} text tokens + 1 image, "
          f"{s.output_len} new tokens) arriving at {rate:g} req/s until the text requests finish; "
          f"{device_name()}")
    print_table([alone, mixed], [("run", "run", "s"), ("seconds", "seconds", ".2f"),
                                 ("tpot_p50_ms", "TPOT p50", ".2f"), ("tpot_p90_ms", "TPOT p90", ".2f"),
                                 ("ttft_p50_ms", "TTFT p50", ".1f"),
                                 ("image_requests_added", "img added", "d"),
                                 ("image_requests_finished", "img done", "d")])
    print(f"with images / alone: TPOT p50 {ratios['tpot_p50']:.2f}x, p90 {ratios['tpot_p90']:.2f}x")
    return dict(rows=[alone, mixed], ratios=ratios, image_rate=rate, text_requests=n_text,
                prompt_len=s.tpot_prompt_len, output_len=s.tpot_output_len)


def bench_qwen2_vl(session: Session) -> dict:
    args, s = session.args, session.scale
    session.release()
    n = args.qwen_requests or s.qwen_requests
    rng = random.Random(5)
    sizes = [rng.choice(s.qwen_sizes) for _ in range(n)]
    images = [distinct_images(1, size, seed=1000 + i)[0] for i, size in enumerate(sizes)]
    prompts = one_image_prompts(s.qwen, images, s.text_len, seed=5)
    hf_rows = hf_side_by_side(args, s, s.qwen, prompts)
    llm = build_llm(args, s.qwen)
    warm_images = [distinct_images(1, size, seed=99)[0] for size in s.qwen_sizes]   # every size compiles
    warm = one_image_prompts(s.qwen, warm_images, s.text_len, seed=99)
    warm_up(llm, warm)
    chorus = generate_timed(llm, prompts, s.output_len)
    processor = llm.llm_engine.processor.mm_processor
    vision = time_vision_tower(llm, [processor.image_processor(img) for img in images[:s.vision_images]],
                               s.vision_batch_sizes)
    del llm
    free_memory()
    sizes_text = ", ".join(f"{w}x{h}" for w, h in s.qwen_sizes)
    print(f"\nqwen2-vl: {n} requests, 1 image each of {len(s.qwen_sizes)} sizes ({sizes_text}) + "
          f"{s.text_len} text tokens, {s.output_len} new tokens; {chorus['prompt_tokens'] / n:.0f} prompt "
          f"tokens per request on average; {device_name()}")
    print_table([chorus] + hf_rows, GENERATE_COLUMNS)
    if hf_rows:
        print(f"Chorus / transformers: {chorus['output_tok_s'] / hf_rows[0]['output_tok_s']:.2f}x end to end")
    print_steps_by_kind(chorus.get("steps_by_kind"))
    print(f"\nvision tower alone ({len(vision[0]['grids']) if vision else 0} images, consecutive batches; "
          f"FLOPs counted analytically; H200 peak {H200_BF16_DENSE_TFLOPS:g} TFLOP/s dense bf16):")
    print_table(vision, [("batch", "batch", "d"), ("calls", "calls", "d"), ("patches", "patches", "d"),
                         *PEAK_COLUMNS])
    return dict(rows=[chorus] + hf_rows, vision=vision, num_requests=n, sizes=s.qwen_sizes, output_len=s.output_len)


def time_vision_tower(llm, processed: list, batch_sizes: tuple[int, ...], iters: int = 3) -> list[dict]:
    """``model.visual`` alone on consecutive batches of the processed images, each batch-size's pass
    timed ``iters`` times after one warm-up pass."""
    model = llm.llm_engine.runner.model
    visual = model.visual
    param = visual.patch_embed.weight
    vc = model.config.vision_config
    rows = []
    for bs in batch_sizes:
        batches = []
        for i in range(0, len(processed), bs):
            chunk = processed[i:i + bs]
            pixels = torch.cat([p.pixel_values for p in chunk]).to(param.device, param.dtype)
            batches.append((pixels, torch.tensor([p.grid_thw for p in chunk], dtype=torch.int64)))
        grids = [tuple(p.grid_thw) for p in processed]

        def one_pass() -> None:
            for pixels, grid in batches:
                visual(pixels, grid)

        seconds = seconds_per_pass(one_pass, iters)
        rows.append(dict(batch=bs, calls=len(batches), patches=sum(t * h * w for t, h, w in grids),
                         grids=grids, **peak_row(vision_flops(grids, vc), seconds, len(batches))))
    return rows


def random_weights(module: torch.nn.Module, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """``module`` on ``device`` in ``dtype`` with every parameter drawn N(0, 0.02) (norm scales 1 + that):
    random weights of a real checkpoint's scale, so no activation overflows."""
    module = module.to(device=device, dtype=dtype).eval()
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen, device=device, dtype=torch.float32) * 0.02
            is_norm_scale = param.dim() == 1 and "norm" in name and name.endswith("weight")
            param.copy_(noise + (1.0 if is_norm_scale else 0.0))
    return module


def qwen2_vl_grid(width: int, height: int, vc) -> tuple[int, int, int]:
    """The (t, h, w) patch grid of one image of width x height pixels (each side rounded to whole merge
    blocks, as the image processor's resize does within its pixel bounds)."""
    block = vc.patch_size * vc.spatial_merge_size
    return (1, max(1, round(height / block)) * vc.spatial_merge_size,
            max(1, round(width / block)) * vc.spatial_merge_size)


def clip_tower_rows(s: Scale, device: str, dtype: torch.dtype) -> list[dict]:
    """CLIP ViT-L/14-336 as LLaVA-1.5 runs it (layers up to -2) on ``s.tower_batch_sizes`` images per call."""
    from transformers import CLIPVisionConfig

    from encoders.clip import CLIPVisionTower

    fields = {k: v for k, v in s.llava.vision.items() if k != "projection_dim"}
    config = CLIPVisionConfig(**fields)
    num_layers = config.num_hidden_layers - 1                           # LLaVA reads layer -2
    tower = random_weights(CLIPVisionTower(config, num_layers=num_layers), dtype, device)
    side = config.image_size
    rows = []
    for bs in s.tower_batch_sizes:
        pixels = torch.randn(bs, 3, side, side, device=device, dtype=dtype)
        seconds = seconds_per_pass(lambda: tower(pixels, [-2]))
        patches = bs * (side // config.patch_size) ** 2
        rows.append(dict(tower=f"{s.llava.name} clip", images=bs, patches=patches,
                         **peak_row(vit_flops(bs, fields, num_layers), seconds, 1)))
    return rows


def qwen2_vl_tower_rows(s: Scale, device: str, dtype: torch.dtype) -> list[dict]:
    """The Qwen2-VL-7B tower on calls of ``s.tower_mixed_repeats`` images of each of ``s.qwen_sizes``."""
    from encoders.qwen2_vl import Qwen2VLVisionTransformer

    vc = build_config(s.qwen, "float32").vision_config
    tower = random_weights(Qwen2VLVisionTransformer(vc), dtype, device)
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    rows = []
    for repeats in s.tower_mixed_repeats:
        grids = [qwen2_vl_grid(w, h, vc) for w, h in s.qwen_sizes] * repeats
        num_patches = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(num_patches, patch_dim, device=device, dtype=dtype)
        grid_thw = torch.tensor(grids, dtype=torch.int64)
        seconds = seconds_per_pass(lambda: tower(pixels, grid_thw))
        rows.append(dict(tower=f"{s.qwen.name} visual", images=len(grids), patches=num_patches,
                         **peak_row(vision_flops(grids, vc), seconds, 1)))
    return rows


def bench_towers(session: Session) -> dict:
    args, s = session.args, session.scale
    session.release()
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    rows = clip_tower_rows(s, device, dtype)
    free_memory()
    rows += qwen2_vl_tower_rows(s, device, dtype)
    free_memory()
    print(f"\nvision towers alone, random {str(dtype).removeprefix('torch.')} weights, one call per row "
          f"(FLOPs counted analytically; H200 peak {H200_BF16_DENSE_TFLOPS:g} TFLOP/s dense bf16); "
          f"{device_name()}:")
    print_table(rows, [("tower", "tower", "s"), ("images", "images", "d"), ("patches", "patches", "d"),
                       *PEAK_COLUMNS])
    return dict(rows=rows, qwen_sizes=s.qwen_sizes)


BENCHES: dict[str, Callable[[Session], dict]] = {
    "llava": bench_llava, "encoder-cache": bench_encoder_cache, "text-tpot": bench_text_tpot,
    "qwen2-vl": bench_qwen2_vl, "towers": bench_towers,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", choices=list(BENCHES) + ["all"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, a handful of requests, CPU float32")
    ap.add_argument("--out", default=None,
                    help="JSON path (default benchmarks/results/vision.json; with --tiny "
                         "benchmarks/out/vision_tiny.json)")
    ap.add_argument("--num-requests", type=int, default=None, help="llava requests (default 1000)")
    ap.add_argument("--hf-requests", type=int, default=None,
                    help="transformers runs the first N llava requests (default 64)")
    ap.add_argument("--hf-batch-size", type=int, default=None, help="default 32")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--cache-requests", type=int, default=None, help="encoder-cache requests (default 400)")
    ap.add_argument("--cache-rate", type=float, default=None,
                    help="encoder-cache paced arrivals, req/s (default 0.6 x the no-cache burst's req/s)")
    ap.add_argument("--encoder-cache-size", type=int, default=None,
                    help="engine encoder cache, embeddings (default: the engine's)")
    ap.add_argument("--cache-model", choices=["llava", "qwen2-vl"], default="llava",
                    help="encoder-cache model: llava (CLIP-L, light next to the LM) or qwen2-vl (its largest "
                         "image size: a heavy tower)")
    ap.add_argument("--cache-output-len", type=int, default=None,
                    help="new tokens of encoder-cache requests (default 32)")
    ap.add_argument("--output-len", type=int, default=None,
                    help="new tokens of llava, qwen2-vl and text-tpot's image requests (default 128)")
    ap.add_argument("--qwen-requests", type=int, default=None, help="qwen2-vl requests (default 500)")
    ap.add_argument("--tpot-image-rate", type=float, default=None, help="text-tpot image req/s (default 10)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default 2048 (--tiny: 512)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    args.scale = TINY if args.tiny else FULL
    if args.output_len:
        args.scale = replace(args.scale, output_len=args.output_len)
    if args.cache_output_len:
        args.scale = replace(args.scale, cache_output_len=args.cache_output_len)
    args.max_model_len = args.max_model_len or (512 if args.tiny else 2048)
    if args.out is None:
        args.out = "benchmarks/out/vision_tiny.json" if args.tiny else "benchmarks/results/vision.json"
    names = list(SUB_BENCHMARKS) if args.bench == "all" else [args.bench]
    print(f"device {device_name()}; torch {torch.__version__}", flush=True)
    session = Session(args)
    report: dict[str, Any] = dict(args={k: v for k, v in vars(args).items() if k != "scale"},
                                  device=device_name(), date=time.strftime("%Y-%m-%d"), elapsed_s={})
    t_all = time.perf_counter()
    for name in names:
        print(f"\n== {name}", flush=True)
        t0 = time.perf_counter()
        report[name] = BENCHES[name](session)
        report["elapsed_s"][name] = time.perf_counter() - t0
        print(f"== {name} took {report['elapsed_s'][name]:.1f} s", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2, default=str)
    session.release()
    print(f"\nall done in {time.perf_counter() - t_all:.1f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
