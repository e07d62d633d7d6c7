"""Image preprocessing throughput: Chorus' CLIP processor vs transformers' on the same JPEGs, one run.

Examples:
    # 64 JPEGs of 1024x768 (quality 90), LLaVA-1.5's CLIP settings (336 px), os.cpu_count() workers
    python benchmarks/preprocess.py
    python benchmarks/preprocess.py --num-images 200 --workers 8

Each image is decoded from its JPEG bytes (``multimodal.media.load_image``) and processed to float32
``pixel_values``, serially, by a thread pool and by a process pool of ``--workers`` (pool start-up and
warm-up are not timed; process-pool results come back to the parent, as the engine needs them).
transformers runs ``CLIPImageProcessorPil`` (its CPU backend without torchvision) the same three ways.
Both outputs are compared on every image first (max abs diff). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

LLAVA_15_CLIP = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}, "resample": 3,
                 "do_center_crop": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                 "image_mean": [0.48145466, 0.4578275, 0.40821073],
                 "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True}
"""llava-hf/llava-1.5-7b-hf's preprocessor_config.json settings."""

PROCESS: Optional[Callable] = None
"""The processor of this process (set by ``init_worker``; one per process pool worker)."""


def make_jpegs(num_images: int, width_px: int, height_px: int, quality: int, seed: int) -> list[bytes]:
    """Photo-like JPEGs: gradients, a few colored rectangles and noise, different per image."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height_px, 0:width_px].astype(np.float32)
    out = []
    for _ in range(num_images):
        fx, fy, phase = rng.uniform(0.002, 0.02, 3), rng.uniform(0.002, 0.02, 3), rng.uniform(0, 6.3, 3)
        pixels = 127.5 + 100 * np.sin(x[..., None] * fx + y[..., None] * fy + phase)   # [H, W, 3]
        for _ in range(8):
            x0, y0 = rng.integers(0, width_px), rng.integers(0, height_px)
            pixels[y0:y0 + rng.integers(20, 300), x0:x0 + rng.integers(20, 300)] = rng.uniform(0, 255, 3)
        pixels += rng.normal(0, 12, pixels.shape)
        buf = io.BytesIO()
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


def build(system: str) -> Callable[[Image.Image], np.ndarray]:
    """image -> ``[3, 336, 336]`` float32 pixel values, by ``system`` ("chorus" or "transformers")."""
    if system == "chorus":
        from multimodal.image_processor import CLIPImageProcessor
        processor = CLIPImageProcessor.from_dict(LLAVA_15_CLIP)
        return lambda image: processor(image).pixel_values.numpy()
    from transformers import CLIPImageProcessorPil
    hf = CLIPImageProcessorPil(**LLAVA_15_CLIP)
    return lambda image: np.asarray(hf(image, return_tensors="np")["pixel_values"][0])


def init_worker(system: str) -> None:
    global PROCESS
    PROCESS = build(system)


def decode_and_process(data: bytes) -> np.ndarray:
    from multimodal.media import load_image
    return PROCESS(load_image(data))


def time_run(executor: Optional[Executor], jobs: list[bytes], warmup: list[bytes]) -> float:
    """Seconds to decode + process ``jobs`` (serially in this process when ``executor`` is None)."""
    if executor is None:
        for data in warmup:
            decode_and_process(data)
        start = time.perf_counter()
        for data in jobs:
            decode_and_process(data)
        return time.perf_counter() - start
    list(executor.map(decode_and_process, warmup))
    start = time.perf_counter()
    list(executor.map(decode_and_process, jobs))
    return time.perf_counter() - start


def run(system: str, kind: str, workers: int, jobs: list[bytes]) -> dict:
    warmup = jobs[:max(2, workers)]
    if kind == "serial":
        init_worker(system)
        seconds = time_run(None, jobs, warmup)
    elif kind == "threads":
        init_worker(system)   # one processor shared by the threads (processors hold no mutable state)
        with ThreadPoolExecutor(workers) as pool:
            seconds = time_run(pool, jobs, warmup)
    else:
        with ProcessPoolExecutor(workers, initializer=init_worker, initargs=(system,)) as pool:
            seconds = time_run(pool, jobs, warmup)
    return dict(system=system, executor=kind, workers=workers if kind != "serial" else 1, images=len(jobs),
                seconds=seconds, images_s=len(jobs) / seconds,
                ms_per_image_per_worker=seconds * 1e3 * (workers if kind != "serial" else 1) / len(jobs))


def max_abs_diff(jobs: list[bytes]) -> float:
    """Largest |chorus - transformers| over every image's pixel values."""
    from multimodal.media import load_image
    chorus, hf = build("chorus"), build("transformers")
    worst = 0.0
    for data in jobs:
        image = load_image(data)
        worst = max(worst, float(np.abs(chorus(image) - hf(image)).max()))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-images", type=int, default=64)
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="thread / process pool size")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--height", type=int, default=768)
    ap.add_argument("--quality", type=int, default=90, help="JPEG quality")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true", help="time Chorus only (the parity check still runs)")
    ap.add_argument("--out", default="benchmarks/results/preprocess.json")
    args = ap.parse_args()
    jobs = make_jpegs(args.num_images, args.width, args.height, args.quality, args.seed)
    diff = max_abs_diff(jobs)
    systems = ["chorus"] + ([] if args.skip_hf else ["transformers"])
    rows = [run(system, kind, args.workers, jobs) for kind in ("serial", "threads", "processes")
            for system in systems]
    for r in rows:
        hf = next((h for h in rows if h["system"] == "transformers" and h["executor"] == r["executor"]), None)
        r["vs_transformers"] = r["images_s"] / hf["images_s"] if hf else None
    mean_kb = sum(map(len, jobs)) / len(jobs) / 1024
    print(f"\nworkload: {len(jobs)} JPEGs {args.width}x{args.height} q{args.quality} ({mean_kb:.0f} KiB mean), "
          f"decode + CLIP 336 px (LLaVA-1.5), {os.cpu_count()} CPUs; max |chorus - transformers| = {diff:.3g}")
    print(f"{'system':14s} {'executor':10s} {'workers':>7s} {'seconds':>8s} {'images/s':>9s} "
          f"{'ms/img/worker':>13s} {'x HF':>6s}")
    for r in rows:
        ratio = f"{r['vs_transformers']:.2f}" if r["vs_transformers"] else "-"
        print(f"{r['system']:14s} {r['executor']:10s} {r['workers']:7d} {r['seconds']:8.2f} {r['images_s']:9.1f} "
              f"{r['ms_per_image_per_worker']:13.2f} {ratio:>6s}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(args=vars(args), cpus=os.cpu_count(), machine=platform.processor() or platform.machine(),
                       max_abs_diff=diff, rows=rows, date=time.strftime("%Y-%m-%d")), f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
