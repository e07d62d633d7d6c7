"""Served vs offline media throughput, the first burst after start-up included (issue #45).

Starts ``chorus serve`` itself (``python -m engine.cli serve MODEL`` with the engine flags below), waits for
/health, then sends two bursts of the same work, each all at once from ``--num-clients`` processes:

- ``--kind image``: ``--num-requests`` image chats (/v1/chat/completions, one random JPEG of
  ``--image-size`` as an ``image_url`` data URL + a short question, ``--max-tokens`` with ignore_eos,
  greedy); measured: output tokens/s.
- ``--kind audio``: ``--num-requests`` transcriptions (/v1/audio/transcriptions, a 30 s WAV tiled from
  tests/data/audio's clips); measured: audio seconds transcribed per second.

Every request of both bursts has its own image / waveform (seeded noise), so no burst reads another's encoder
or prefix cache. The first burst is sent as soon as the server answers /health (no untimed warm-up): it is
what a user sees right after start-up. The server is stopped, then a separate process runs the same two
bursts offline (``LLM.chat`` / ``LLM.transcribe``, each burst one call, timed from the call to its return),
or ``--offline-json`` gives that process's JSON. Either side's time includes its media preprocessing (the
server's as requests arrive; ``LLM``'s on ``mm_processor_workers`` threads, every item before the first step).
The table: served / offline per burst, and the served first burst / second burst; JSON with ``--out``.

    python benchmarks/serve_media.py --kind image --model DIR --load-format dummy --num-requests 256 \\
        --num-clients 4 --image-size 1024x768 --max-tokens 128 --out serve_media_llava.json

``--llava-15-7b-dummy`` uses benchmarks/vision.py's config-only LLaVA-1.5-7B directory (random bf16 weights);
``--turbo-dir DIR`` is benchmarks/whisper.py's config-only large-v3-turbo directory (``--kind audio``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import multiprocessing
import os
import subprocess
import sys
import time
import wave
from pathlib import Path
from typing import Any, Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
AUDIO_DIR = REPO / "tests" / "data" / "audio"
SAMPLE_RATE_HZ = 16000
CLIP_S = 30.0
QUESTION = "Describe the picture in detail."
BURSTS = ("first", "second")
LLAVA_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() + ': ' }}{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}{{ '<image> ' }}{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ ' ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
"""LLaVA-1.5's prompt format (``USER: <image> question ASSISTANT:``), for the config-only directory's
tokenizer, which has no chat template."""


# ----------------------------------------------------------------------------------------
# Work
# ----------------------------------------------------------------------------------------
def image_jpeg(size: tuple[int, int], seed: int) -> bytes:
    """A JPEG (quality 90) of random pixels, (width, height)."""
    from PIL import Image
    width, height = size
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.frombytes("RGB", (width, height), rng.bytes(width * height * 3)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def image_messages(size: tuple[int, int], seed: int) -> list[dict]:
    url = "data:image/jpeg;base64," + base64.b64encode(image_jpeg(size, seed)).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


def speech_cycle() -> np.ndarray:
    """tests/data/audio's speech clips laid end to end, float32 at 16 kHz."""
    import soundfile
    pieces = []
    for name in ("fox", "hello", "weather", "meeting"):
        samples, rate = soundfile.read(AUDIO_DIR / f"{name}.wav", dtype="float32")
        if rate != SAMPLE_RATE_HZ:
            raise ValueError(f"{name}.wav is at {rate} Hz, not {SAMPLE_RATE_HZ}")
        pieces.append(samples if samples.ndim == 1 else samples.mean(axis=1))
    return np.concatenate(pieces).astype(np.float32)


def audio_clip(cycle: np.ndarray, seed: int) -> np.ndarray:
    """A 30 s clip: the speech cycle tiled from a seeded start, plus seeded noise (a distinct hash)."""
    window = int(CLIP_S * SAMPLE_RATE_HZ)
    rng = np.random.default_rng(seed)
    tiled = np.tile(cycle, -(-2 * window // cycle.shape[0]))
    start = int(rng.integers(0, tiled.shape[0] - window))
    return (tiled[start:start + window] + 1e-3 * rng.standard_normal(window)).astype(np.float32)


def wav_bytes(samples: np.ndarray) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE_HZ)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def seeds(args: argparse.Namespace, burst: int) -> list[int]:
    """Request seeds of burst 0 / 1 (distinct across bursts)."""
    return [args.seed + burst * args.num_requests + i for i in range(args.num_requests)]


# ----------------------------------------------------------------------------------------
# Served
# ----------------------------------------------------------------------------------------
OPTIONAL_LIMITS = ("max_model_len", "max_num_seqs", "max_num_encoder_input_tokens")
"""Engine limits passed to both sides when given (``chorus serve`` flags / ``LLM`` keywords)."""


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--dtype", args.dtype, "--device", args.device, "--load-format", args.load_format,
             "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--seed", "0"]
    for name in OPTIONAL_LIMITS:
        if getattr(args, name):
            flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args.chat_template:
        flags += ["--chat-template", args.chat_template]
    if args.enforce_eager:
        flags.append("--enforce-eager")
    return flags


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = dict(dtype=args.dtype, device=args.device, load_format=args.load_format,
                              gpu_memory_utilization=args.gpu_memory_utilization, seed=0,
                              enforce_eager=args.enforce_eager)
    kw.update({name: getattr(args, name) for name in OPTIONAL_LIMITS if getattr(args, name)})
    return kw


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, float]:
    """``chorus serve`` on ``--port``; returns (process, seconds until /health answered)."""
    import httpx
    cmd = [sys.executable, "-m", "engine.cli", "serve", args.model, "--port", str(args.port),
           "--served-model-name", "bench", "--disable-log-requests", *engine_flags(args)]
    log = open(log_path, "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); its log: {log_path}\n"
                               + log_path.read_text()[-3000:])
        if time.perf_counter() - t0 > args.start_timeout_s:
            proc.kill()
            raise RuntimeError(f"the server did not answer /health in {args.start_timeout_s:.0f} s ({log_path})")
        try:
            if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=2.0).status_code == 200:
                return proc, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def _build_bodies(args: argparse.Namespace, my_seeds: list[int]) -> list:
    if args.kind == "image":
        return [image_messages(args.image_size, s) for s in my_seeds]
    cycle = speech_cycle()
    return [wav_bytes(audio_clip(cycle, s)) for s in my_seeds]


async def _send_all(args: argparse.Namespace, bodies: list) -> tuple[int, int, float]:
    """This client's requests, all at once -> (ok, output tokens, time.time() of the last answer)."""
    import httpx
    base = f"http://127.0.0.1:{args.port}"
    limits = httpx.Limits(max_connections=len(bodies) + 1, max_keepalive_connections=len(bodies) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout_s), limits=limits) as client:
        async def one(body) -> tuple[bool, int]:
            if args.kind == "image":
                r = await client.post(f"{base}/v1/chat/completions", json={
                    "model": "bench", "messages": body, "max_tokens": args.max_tokens, "temperature": 0.0,
                    "ignore_eos": True})
                ok = r.status_code == 200
                return ok, (r.json().get("usage") or {}).get("completion_tokens", 0) if ok else 0
            r = await client.post(f"{base}/v1/audio/transcriptions", data={"model": "bench", "language": "en"},
                                  files={"file": ("clip.wav", body, "audio/wav")})
            return r.status_code == 200, 0
        results = await asyncio.gather(*(one(b) for b in bodies))
    return sum(ok for ok, _ in results), sum(n for _, n in results), time.time()


def _client(args: argparse.Namespace, my_seeds: list[int], ready, go, results) -> None:
    bodies = _build_bodies(args, my_seeds)
    ready.put(len(bodies))
    go.wait()
    results.put(asyncio.run(_send_all(args, bodies)))


def served_burst(args: argparse.Namespace, burst: int) -> dict[str, Any]:
    """One burst from ``--num-clients`` processes (each every K-th request): every client builds its requests
    first, then all send at once; timed from that moment to the last answer."""
    all_seeds = seeds(args, burst)
    ctx = multiprocessing.get_context("fork")   # the parent holds no engine
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_client, args=(args, all_seeds[k::args.num_clients], ready, go, results))
             for k in range(args.num_clients)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get()
    start = time.time()
    go.set()
    done = [results.get() for _ in procs]
    for p in procs:
        p.join()
    ok, tokens = sum(r[0] for r in done), sum(r[1] for r in done)
    return burst_row(args, ok, tokens, max(r[2] for r in done) - start)


def burst_row(args: argparse.Namespace, ok: int, tokens: int, seconds: float) -> dict[str, Any]:
    row = {"requests": args.num_requests, "ok": ok, "seconds": seconds}
    if args.kind == "image":
        row.update(output_tokens=tokens, rate=tokens / seconds, unit="output tok/s")
    else:
        row.update(audio_s=ok * CLIP_S, rate=ok * CLIP_S / seconds, unit="audio s/s")
    return row


# ----------------------------------------------------------------------------------------
# Offline
# ----------------------------------------------------------------------------------------
def offline(args: argparse.Namespace) -> dict[str, Any]:
    """Both bursts through ``LLM`` in this process (engine built first, untimed)."""
    from engine import LLM
    from engine.sampling_params import SamplingParams
    llm = LLM(args.model, **engine_kwargs(args))
    rows = {}
    cycle = speech_cycle() if args.kind == "audio" else None
    for burst, name in enumerate(BURSTS):
        if args.kind == "image":
            convs = [image_messages(args.image_size, s) for s in seeds(args, burst)]
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
            t0 = time.perf_counter()
            outs = llm.chat(convs, params, use_tqdm=False, chat_template=args.chat_template)
            seconds = time.perf_counter() - t0
            rows[name] = burst_row(args, len(outs), sum(len(o.outputs[0].token_ids) for o in outs), seconds)
        else:
            clips = [(audio_clip(cycle, s), SAMPLE_RATE_HZ) for s in seeds(args, burst)]
            t0 = time.perf_counter()
            outs = llm.transcribe(clips, language="en")
            rows[name] = burst_row(args, len(outs), 0, time.perf_counter() - t0)
    llm.close()
    return rows


def run_offline_process(args: argparse.Namespace, out_path: Path) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), *args.argv, "--offline-only", "--out", str(out_path)]
    subprocess.run(argv, cwd=REPO, check=True)
    return json.loads(out_path.read_text())["offline"]


# ----------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------
def print_table(summary: dict[str, Any]) -> None:
    unit = summary["served"]["first"]["unit"]
    print(f"{'burst':<8}{'served ' + unit:>24}{'offline ' + unit:>24}{'served / offline':>18}{'ok':>8}")
    for name in BURSTS:
        s, o = summary["served"][name], summary["offline"][name]
        print(f"{name:<8}{s['rate']:>24.1f}{o['rate']:>24.1f}{summary['ratio'][name]:>18.3f}"
              f"{s['ok']:>5}/{s['requests']}")
    print(f"served first burst / second burst: {summary['served_first_over_second']:.3f}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=["image", "audio"], default="image")
    p.add_argument("--model", default=None, help="Checkpoint directory (config-only with --load-format dummy).")
    p.add_argument("--llava-15-7b-dummy", action="store_true",
                   help="benchmarks/vision.py's LLaVA-1.5-7B config-only directory, random bf16 weights.")
    p.add_argument("--turbo-dir", default=None,
                   help="benchmarks/whisper.py's large-v3-turbo config-only directory, random weights.")
    p.add_argument("--chat-template", default=None,
                   help="Chat template text for both sides (default: the tokenizer's; LLaVA-1.5's with "
                        "--llava-15-7b-dummy).")
    p.add_argument("--num-requests", type=int, default=256, help="Requests per burst.")
    p.add_argument("--num-clients", type=int, default=4, help="Client processes sending each burst.")
    p.add_argument("--image-size", default="1024x768", help="WIDTHxHEIGHT of the random images.")
    p.add_argument("--max-tokens", type=int, default=128, help="Image chats: output tokens (ignore_eos).")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-encoder-input-tokens", type=int, default=None,
                   help="Embeddings one step may encode (benchmarks/whisper.py runs 32 windows: 48000).")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--timeout-s", type=float, default=1200.0, help="Per-request timeout.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offline-json", default=None, help="The offline side from an earlier run's JSON.")
    p.add_argument("--offline-only", action="store_true", help="Run only the offline side (a subprocess).")
    p.add_argument("--server-log", default=None, help="Where the server's output goes (default: beside --out).")
    p.add_argument("--out", default=None, help="Write the summary JSON here.")
    return p


def resolve_model(args: argparse.Namespace) -> None:
    if args.llava_15_7b_dummy:
        from benchmarks.vision import LLAVA_15_7B, dummy_checkpoint
        args.model, args.load_format = str(dummy_checkpoint(LLAVA_15_7B, args.dtype)), "dummy"
        args.chat_template = args.chat_template or LLAVA_CHAT_TEMPLATE
    elif args.turbo_dir:
        args.model, args.load_format = args.turbo_dir, "dummy"
    if not args.model:
        raise SystemExit("name --model, --llava-15-7b-dummy or --turbo-dir")


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = [a for a in argv if a != "--offline-only"]
    if "--out" in args.argv:   # the offline subprocess writes its own
        i = args.argv.index("--out")
        del args.argv[i:i + 2]
    width, height = (int(v) for v in args.image_size.lower().split("x"))
    args.image_size = (width, height)
    resolve_model(args)
    if args.offline_only:
        summary = {"offline": offline(args)}
        if args.out:
            Path(args.out).write_text(json.dumps(summary, indent=2))
        return summary
    out_dir = Path(args.out).resolve().parent if args.out else Path(os.environ.get("TMPDIR", "/tmp"))
    log_path = Path(args.server_log) if args.server_log else out_dir / f"serve_media_{args.kind}_server.log"
    proc, ready_s = start_server(args, log_path)
    print(f"server ready after {ready_s:.1f} s", flush=True)
    served = {}
    try:
        for burst, name in enumerate(BURSTS):
            served[name] = served_burst(args, burst)
            print(f"served {name} burst: {served[name]['rate']:.1f} {served[name]['unit']} "
                  f"({served[name]['ok']}/{args.num_requests} ok, {served[name]['seconds']:.2f} s)", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if args.offline_json:
        off = json.loads(Path(args.offline_json).read_text())["offline"]
    else:
        off = run_offline_process(args, out_dir / f"serve_media_{args.kind}_offline.json")
    summary = {"kind": args.kind, "model": args.model, "num_requests": args.num_requests,
               "num_clients": args.num_clients, "server_ready_s": ready_s, "served": served, "offline": off,
               "ratio": {name: served[name]["rate"] / off[name]["rate"] if off[name]["rate"] else 0.0
                         for name in BURSTS},
               "served_first_over_second": served["first"]["rate"] / served["second"]["rate"]
               if served["second"]["rate"] else 0.0}
    if args.kind == "image":
        summary.update(image_size=list(args.image_size), max_tokens=args.max_tokens)
    print_table(summary)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
