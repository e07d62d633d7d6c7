"""Soak: a mixed request stream above the server's capacity, then leak and determinism checks.

Drives one server (started here as ``chorus serve`` in a subprocess, or one already running with
``--url``) with text completions and chats, streamed and not, ``n`` > 1, stop strings, requests on 16
adapters loaded and unloaded at run time (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``) while
the stream runs, image chats (vision models) and transcriptions (with a Whisper model next to the chat
model), with ``--disconnect-frac`` of the clients closing the connection at a random point (before the
answer or mid-stream). Then:

- every request not cancelled answered 200 (no in-band stream error), and its greedy output equals the
  same request sent alone afterwards (one at a time, same server, same adapter);
- after a short settle, /metrics shows nothing held: running / waiting / tracked requests, KV blocks,
  adapter slots, adapters registered (all unloaded), referenced encoder-cache entries and embeddings;
- the server's RSS (its process tree, ``/proc/<pid>/status``) and GPU memory (``nvidia-smi``, on CUDA
  machines) after warm-up, as growth per 1,000 requests (a least-squares slope).

Default (no ``--model``): the tests' tiny random checkpoints, built into a temp dir (a tiny LLaVA as
the chat model, a tiny random Whisper as ``--transcription-model``) and 16 random adapters, served in
float32 with a small KV cache (preemptions), small step and encoder budgets (chunked prefill,
encoder-cache evictions) and 4 adapter slots (slot swaps). With ``--model``, 16 random rank-8 adapters
on q_proj / v_proj are written from its config.json (no weights loaded).

    python benchmarks/soak.py --num-requests 1000 --out soak.json                 # tiny models, CPU
    python benchmarks/soak.py --num-requests 10000 --concurrency 256 --model /path/to/llama \\
        --server-args "--dtype float32" --compare-frac 0.1 --out soak.json        # a GPU (add
        # --transcription-model default|PATH for audio, a LLaVA / Qwen2-VL --model for images)

Greedy equality with the request run alone is exact on the tiny float32 checkpoints (wide logit
margins); a large model in bfloat16 may flip a near tie when the batch changes, so a mismatch says
where the texts part (``diverges_at_char``): late and rare is rounding, early or frequent a bug. Memory
is judged after warm-up because caches fill first (a CPU KV cache is calloc'd: its pages count once
touched).

The checks' core is ``run_soak`` (async; ``tests/robustness/test_soak.py`` runs it on CI's tiny model).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import httpx

ROOT = Path(__file__).resolve().parents[1]

IDLE_GAUGES = ("chorus:num_requests_running", "chorus:num_requests_waiting", "chorus:num_requests_tracked",
               "chorus:num_kv_blocks_in_use", "chorus:num_lora_slots_in_use",
               "chorus:num_encoder_cache_entries_in_use", "chorus:num_encoder_cache_embeds_in_use",
               "chorus:num_loras_registered", "chorus:num_active_loras")
"""/metrics gauges that must read 0 (summed over the served models) once the soak is over and every
adapter is unloaded."""
WORDS = ("the quick brown fox jumps over lazy dog paged attention keeps cache in fixed size blocks a "
         "scheduler hands out one token budget per step low rank adapters add small update to each "
         "projection what is capital of France Paris numbers 0 1 2 3 4 5 6 7 8 9 hello world how are you "
         "today").split()
STOP_STRINGS = ("e", "th", " a", ".", "\n", "o ")
MIB = 1 << 20


@dataclass
class SoakConfig:
    """The workload and the checks."""

    num_requests: int = 1000
    concurrency: int = 32
    """Requests in flight at once (above the server's max_num_seqs: a waiting queue)."""
    disconnect_frac: float = 0.1
    """Fraction of requests whose client closes the connection at a random point."""
    seed: int = 0
    max_tokens: int = 16
    """Output tokens per request: uniform in 1..max_tokens."""
    stream_frac: float = 0.5
    chat_frac: float = 0.5
    """Of the text requests, chats (the rest: completions)."""
    image_frac: float = 0.15
    """Image chats (vision models only)."""
    audio_frac: float = 0.05
    """Transcriptions (servers with a Whisper model only)."""
    lora_frac: float = 0.4
    """Text and image requests on an adapter (when the server has some)."""
    num_lora_churns: int = 6
    """Times during the stream that 2 adapters are unloaded and 2 others loaded."""
    request_timeout_s: float = 120.0
    """A request without an answer by then is a hang (counted as a failure)."""
    max_disconnect_after_s: float = 0.3
    """Disconnects by time happen uniformly in (0, this]."""
    settle_s: float = 10.0
    """How long to wait for the idle gauges to reach 0."""
    warmup_frac: float = 0.2
    """Memory growth is fitted over the requests after this fraction."""
    sample_interval_s: float = 0.25
    """Memory sampling period."""
    compare_frac: float = 1.0
    """Fraction of the completed requests sent again alone (a seeded sample; 1: all). Each runs by
    itself, so on a large model the comparison takes longer than the soak: a GPU run of 10,000
    requests compares a sample."""


@dataclass
class Served:
    """What the server offers the soak."""

    url: str
    """http://host:port"""
    model: str
    """The chat model's served name."""
    adapters: dict[str, str] = field(default_factory=dict)
    """Adapter name -> directory the server can read (loaded and unloaded by the soak)."""
    images: bool = False
    """The chat model takes images."""
    whisper_model: Optional[str] = None
    """The Whisper model's served name, if any."""
    pid: Optional[int] = None
    """The server's process id, for RSS (None: not measured)."""


@dataclass
class Disconnect:
    after_s: float
    """Close the connection this long after sending (if no full answer by then)."""
    after_chunks: Optional[int] = None
    """Streams: close after this many ``data:`` events instead (0: as soon as the headers arrive)."""


@dataclass
class RequestSpec:
    index: int
    route: str
    """completions | chat | transcriptions"""
    body: dict[str, Any]
    """JSON body (or multipart form fields) without ``model``."""
    stream: bool
    on_adapter: bool = False
    adapter_pick: float = 0.0
    """Which of the adapters loaded at send time, as a fraction of their sorted list."""
    audio: Optional[bytes] = None
    disconnect: Optional[Disconnect] = None


@dataclass
class RequestResult:
    index: int
    model: str
    status: Optional[int] = None
    cancelled: bool = False
    output: Any = None
    """Completions and chats: [[text, finish_reason], ...] by choice index; transcriptions: the text."""
    error: Optional[str] = None
    latency_s: float = 0.0


@dataclass
class MemorySample:
    num_done: int
    rss_bytes: int
    gpu_bytes: Optional[int]


# ----------------------------------------------------------------------------------------
# Workload
# ----------------------------------------------------------------------------------------
def make_workload(cfg: SoakConfig, served: Served, images: list[bytes],
                  clips: list[bytes]) -> list[RequestSpec]:
    """The seeded request list (adapters are picked at send time among those loaded)."""
    rng = random.Random(cfg.seed)
    prefixes = [" ".join(rng.choices(WORDS, k=rng.randint(8, 40))) for _ in range(8)]
    specs = []
    for i in range(cfg.num_requests):
        roll = rng.random()
        if served.whisper_model and clips and roll < cfg.audio_frac:
            spec = _audio_spec(rng, i, clips)
        elif served.images and images and roll < cfg.audio_frac + cfg.image_frac:
            spec = _text_spec(rng, i, cfg, prefixes, images=[_data_url(rng.choice(images))
                                                             for _ in range(rng.randint(1, 2))])
        else:
            spec = _text_spec(rng, i, cfg, prefixes)
        if rng.random() < cfg.disconnect_frac:
            spec.disconnect = Disconnect(after_s=rng.uniform(0.001, cfg.max_disconnect_after_s),
                                         after_chunks=rng.randint(0, 4) if spec.stream and rng.random() < 0.5
                                         else None)
        specs.append(spec)
    return specs


def _text_spec(rng: random.Random, index: int, cfg: SoakConfig, prefixes: list[str],
               images: Optional[list[str]] = None) -> RequestSpec:
    text = rng.choice(prefixes) + " " + " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))
    body: dict[str, Any] = {"max_tokens": rng.randint(1, cfg.max_tokens), "temperature": 0,
                            "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.3:
        body["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
    if rng.random() < 0.2:
        body["n"] = rng.randint(2, 3)
    stream = rng.random() < cfg.stream_frac
    if images or rng.random() < cfg.chat_frac:
        content: Any = text
        if images:
            content = [{"type": "image_url", "image_url": {"url": u}} for u in images]
            content.append({"type": "text", "text": text})
        body["messages"] = [{"role": "user", "content": content}]
        route = "chat"
    else:
        body["prompt"] = text
        route = "completions"
    return RequestSpec(index, route, body, stream, on_adapter=rng.random() < cfg.lora_frac,
                       adapter_pick=rng.random())


def _audio_spec(rng: random.Random, index: int, clips: list[bytes]) -> RequestSpec:
    stream = rng.random() < 0.5
    fields = {"response_format": "json" if stream else rng.choice(["json", "text"])}
    return RequestSpec(index, "transcriptions", fields, stream, audio=rng.choice(clips))


def make_images(num: int, seed: int) -> list[bytes]:
    """``num`` small random PNGs (distinct content hashes)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        w, h = (int(x) for x in rng.integers(24, 80, size=2))
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def make_clips(num: int) -> list[bytes]:
    """``num`` gated tones of 1..3 s as WAV bytes (distinct audio)."""
    import numpy as np
    import soundfile

    out = []
    for i in range(num):
        t = np.arange(int(16000 * (1.0 + i % 3))) / 16000
        wave = 0.3 * np.sin(2 * np.pi * (220.0 + 55 * i) * t) * (np.sin(2 * np.pi * 2 * t) > 0)
        buf = io.BytesIO()
        soundfile.write(buf, wave.astype(np.float32), 16000, format="WAV", subtype="FLOAT")
        out.append(buf.getvalue())
    return out


def _data_url(png: bytes) -> str:
    import base64
    return "data:image/png;base64," + base64.b64encode(png).decode()


# ----------------------------------------------------------------------------------------
# One request
# ----------------------------------------------------------------------------------------
class Admission:
    """Per adapter, the requests in flight that the server may not have admitted yet (an unload must
    wait for them, or they would get a 404): non-streamed requests until they end, streams until their
    headers arrive (a stream's headers are sent once its engine requests are added)."""

    def __init__(self) -> None:
        self.pending: dict[str, int] = {}
        self.changed = asyncio.Event()

    def add(self, name: str) -> None:
        self.pending[name] = self.pending.get(name, 0) + 1

    def done(self, name: str) -> None:
        self.pending[name] -= 1
        self.changed.set()

    async def wait_clear(self, name: str) -> None:
        while self.pending.get(name, 0):
            self.changed.clear()
            await self.changed.wait()


async def send(client: httpx.AsyncClient, served: Served, spec: RequestSpec, model: str,
               timeout_s: float, disconnect: Optional[Disconnect] = None,
               on_admitted: Any = None) -> RequestResult:
    """Send one request (closing the connection early per ``disconnect``) and read its answer.
    ``on_admitted`` is called once, when the server has the request or the request is over."""
    result = RequestResult(spec.index, model)
    admitted = [False]

    def admit() -> None:
        if not admitted[0]:
            admitted[0] = True
            if on_admitted is not None:
                on_admitted()

    start = time.monotonic()
    work = asyncio.ensure_future(_exchange(client, served, spec, model, result, disconnect, admit))
    by_time = disconnect is not None and disconnect.after_chunks is None
    limit_s = min(timeout_s, disconnect.after_s) if by_time else timeout_s
    try:
        await asyncio.wait_for(asyncio.shield(work), limit_s)
    except asyncio.TimeoutError:
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        if by_time and limit_s < timeout_s:
            result.cancelled = True
        else:
            result.error = f"no answer in {timeout_s:.0f} s"
    except Exception as e:  # noqa: BLE001 - a transport failure is a result
        result.error = f"{type(e).__name__}: {e}"
    finally:
        admit()
    result.latency_s = time.monotonic() - start
    return result


async def _exchange(client: httpx.AsyncClient, served: Served, spec: RequestSpec, model: str,
                    result: RequestResult, disconnect: Optional[Disconnect], admit: Any) -> None:
    if spec.route == "transcriptions":
        url = f"{served.url}/v1/audio/transcriptions"
        kwargs: dict[str, Any] = {"data": {**spec.body, "model": model, "stream": str(spec.stream).lower()},
                                  "files": {"file": ("clip.wav", spec.audio, "audio/wav")}}
    else:
        url = f"{served.url}/v1/{'chat/completions' if spec.route == 'chat' else 'completions'}"
        kwargs = {"json": {**spec.body, "model": model, "stream": spec.stream}}
    if not spec.stream:
        resp = await client.post(url, **kwargs)
        result.status = resp.status_code
        if resp.status_code == 200:
            result.output = parse_answer(spec, resp)
        else:
            result.error = resp.text[:300]
        return
    async with client.stream("POST", url, **kwargs) as resp:
        result.status = resp.status_code
        admit()
        if resp.status_code != 200:
            result.error = (await resp.aread()).decode(errors="replace")[:300]
            return
        events = []
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if disconnect is not None and disconnect.after_chunks is not None \
                    and len(events) > disconnect.after_chunks and events[-1] != "[DONE]":
                result.cancelled = True
                return   # leaving the block closes the connection mid-stream
        result.output, result.error = parse_stream(spec, events)


def parse_answer(spec: RequestSpec, resp: httpx.Response) -> Any:
    if spec.route == "transcriptions":
        return resp.json()["text"] if spec.body.get("response_format") == "json" else resp.text.strip()
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    if spec.route == "chat":
        return [[c["message"]["content"], c["finish_reason"]] for c in choices]
    return [[c["text"], c["finish_reason"]] for c in choices]


def parse_stream(spec: RequestSpec, events: list[str]) -> tuple[Any, Optional[str]]:
    """(normalized output, in-band error) of a finished SSE stream."""
    if not events or events[-1] != "[DONE]":
        if spec.route != "transcriptions":
            return None, "stream ended without [DONE]"
    texts: dict[int, list] = {}
    transcript = None
    for payload in events:
        if payload == "[DONE]":
            continue
        obj = json.loads(payload)
        if "error" in obj:
            return None, f"in-band error: {obj['error']}"
        if spec.route == "transcriptions":
            if obj.get("type") == "transcript.text.done":
                transcript = obj["text"]
            continue
        for c in obj.get("choices", []):
            entry = texts.setdefault(c["index"], ["", None])
            delta = c.get("delta", {}).get("content") if spec.route == "chat" else c.get("text")
            entry[0] += delta or ""
            if c.get("finish_reason") is not None:
                entry[1] = c["finish_reason"]
    if spec.route == "transcriptions":
        return (transcript, None) if transcript is not None else (None, "no transcript.text.done event")
    return [texts[i] for i in sorted(texts)], None


# ----------------------------------------------------------------------------------------
# Server state: adapters, metrics, memory
# ----------------------------------------------------------------------------------------
async def load_adapter(client: httpx.AsyncClient, served: Served, name: str) -> Optional[str]:
    resp = await client.post(f"{served.url}/v1/load_lora_adapter",
                             json={"lora_name": name, "lora_path": served.adapters[name]})
    return None if resp.status_code == 200 else f"load {name}: {resp.status_code} {resp.text[:200]}"


async def unload_adapter(client: httpx.AsyncClient, served: Served, name: str) -> Optional[str]:
    resp = await client.post(f"{served.url}/v1/unload_lora_adapter", json={"lora_name": name})
    return None if resp.status_code == 200 else f"unload {name}: {resp.status_code} {resp.text[:200]}"


def parse_gauges(text: str) -> dict[str, float]:
    """``chorus:*`` samples of /metrics, summed over labels (both engines' ``model_name``)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith("chorus:"):
            continue
        key, value = line.rsplit(" ", 1)
        name = key.split("{", 1)[0]
        totals[name] = totals.get(name, 0.0) + float(value)
    return totals


async def settle(client: httpx.AsyncClient, served: Served, timeout_s: float) -> dict[str, float]:
    """/metrics once every idle gauge reads 0, or after ``timeout_s``: the gauges then."""
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = parse_gauges((await client.get(f"{served.url}/metrics")).text)
        if all(gauges.get(g, 0.0) == 0 for g in IDLE_GAUGES) or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(0.1)


def process_tree_rss_bytes(pid: int) -> int:
    """VmRSS of ``pid`` and its descendants (an engine in its own process counts)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def gpu_used_bytes() -> Optional[int]:
    """Device memory in use on every GPU (``nvidia-smi``), or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return sum(int(x) for x in out.split()) * MIB
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def growth_per_1k(samples: list[MemorySample], attr: str, warmup_done: int) -> Optional[float]:
    """Least-squares slope of ``attr`` (MiB) against finished requests after warm-up, x 1,000."""
    pts = [(s.num_done, getattr(s, attr) / MIB) for s in samples
           if s.num_done >= warmup_done and getattr(s, attr) is not None]
    if len(pts) < 3 or pts[-1][0] == pts[0][0]:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    return 1000.0 * sum((x - mx) * (y - my) for x, y in pts) / var if var else None


# ----------------------------------------------------------------------------------------
# The soak
# ----------------------------------------------------------------------------------------
@dataclass
class SoakReport:
    num_requests: int
    num_completed: int
    num_cancelled: int
    num_failed: int
    """Not cancelled and not a 200 with a full answer (5xx, 4xx, in-band errors, hangs)."""
    num_5xx: int
    num_mismatches: int
    num_compared: int
    duration_s: float
    requests_per_s: float
    by_route: dict[str, int]
    adapter_errors: list[str]
    failures: list[dict]
    """The first failures (index, status, error)."""
    mismatches: list[dict]
    """The first mismatches (index, soak output, alone output)."""
    gauges_after_soak: dict[str, float]
    gauges_after_reference: dict[str, float]
    leaked: dict[str, float]
    """Idle gauges not back at 0 (after the soak or after the reference run)."""
    rss_start_mib: Optional[float]
    rss_warm_mib: Optional[float]
    """At the end of warm-up (the first sample after ``warmup_frac`` of the requests finished)."""
    rss_end_mib: Optional[float]
    rss_growth_mib_per_1k: Optional[float]
    gpu_growth_mib_per_1k: Optional[float]
    num_preemptions: float
    max_num_reqs_per_step: float

    @property
    def ok(self) -> bool:
        return not (self.num_failed or self.num_mismatches or self.leaked or self.adapter_errors)


async def run_soak(served: Served, cfg: SoakConfig, images: Optional[list[bytes]] = None,
                   clips: Optional[list[bytes]] = None) -> SoakReport:
    """Drive the mixed stream, then run every finished request alone and compare; see the module doc."""
    images = images if images is not None else (make_images(6, cfg.seed) if served.images else [])
    clips = clips if clips is not None else (make_clips(3) if served.whisper_model else [])
    specs = make_workload(cfg, served, images, clips)
    # NOTE: idle connections expire before the server's 5 s keep-alive (uvicorn's): at httpx's default of
    # 5 s a request may go out on a connection the server is closing (a ReadError).
    limits = httpx.Limits(max_connections=cfg.concurrency + 8, max_keepalive_connections=cfg.concurrency + 8,
                          keepalive_expiry=2.0)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(cfg.request_timeout_s)) as client:
        start = time.monotonic()
        results, samples, adapter_errors, loaded = await _drive(client, served, cfg, specs)
        duration_s = time.monotonic() - start
        for name in loaded:
            if err := await unload_adapter(client, served, name):
                adapter_errors.append(err)
        after_soak = await settle(client, served, cfg.settle_s)
        mismatches, num_compared = await _compare_alone(client, served, cfg, specs, results, adapter_errors)
        after_reference = await settle(client, served, cfg.settle_s)
    return _report(cfg, specs, results, samples, adapter_errors, mismatches, num_compared, duration_s,
                   after_soak, after_reference)


async def _drive(client: httpx.AsyncClient, served: Served, cfg: SoakConfig, specs: list[RequestSpec]
                 ) -> tuple[list[RequestResult], list[MemorySample], list[str], list[str]]:
    """The concurrent stream: (results by index, memory samples, adapter errors, adapters still loaded)."""
    names = sorted(served.adapters)
    loaded: list[str] = []
    adapter_errors: list[str] = []
    for name in names[:len(names) // 2]:
        err = await load_adapter(client, served, name)
        adapter_errors += [err] if err else []
        loaded += [] if err else [name]
    unloaded = [n for n in names if n not in loaded]
    draining: set[str] = set()
    admission = Admission()
    results: list[RequestResult] = []
    samples: list[MemorySample] = []
    sem = asyncio.Semaphore(cfg.concurrency)
    churn_every = cfg.num_requests // (cfg.num_lora_churns + 1) if names and cfg.num_lora_churns else 0

    async def churn() -> None:
        """Unload the 2 longest-loaded adapters (once the server has admitted their requests), load 2."""
        out = [n for n in loaded if n not in draining][:2]
        draining.update(out)
        for name in out:
            await admission.wait_clear(name)
            err = await unload_adapter(client, served, name)
            adapter_errors.extend([err] if err else [])
            loaded.remove(name)
            draining.discard(name)
            unloaded.append(name)
        for name in [unloaded.pop(0) for _ in range(min(2, len(unloaded)))]:
            err = await load_adapter(client, served, name)
            adapter_errors.extend([err] if err else [])
            (unloaded if err else loaded).append(name)

    async def one(spec: RequestSpec) -> None:
        try:
            model = served.whisper_model if spec.route == "transcriptions" else served.model
            usable = [n for n in loaded if n not in draining]
            if spec.on_adapter and usable:
                model = usable[int(spec.adapter_pick * len(usable))]
                admission.add(model)
                results.append(await send(client, served, spec, model, cfg.request_timeout_s, spec.disconnect,
                                          on_admitted=lambda: admission.done(model)))
            else:
                results.append(await send(client, served, spec, model, cfg.request_timeout_s,
                                          spec.disconnect))
        finally:
            sem.release()

    async def sample() -> None:
        while True:
            if served.pid is not None:
                samples.append(MemorySample(len(results), process_tree_rss_bytes(served.pid),
                                            gpu_used_bytes()))
            await asyncio.sleep(cfg.sample_interval_s)

    sampler = asyncio.ensure_future(sample())
    tasks = []
    for spec in specs:
        if churn_every and spec.index and spec.index % churn_every == 0 \
                and spec.index // churn_every <= cfg.num_lora_churns:
            tasks.append(asyncio.ensure_future(churn()))
        await sem.acquire()
        tasks.append(asyncio.ensure_future(one(spec)))
    await asyncio.gather(*tasks)
    sampler.cancel()
    await asyncio.gather(sampler, return_exceptions=True)
    if served.pid is not None:
        samples.append(MemorySample(len(results), process_tree_rss_bytes(served.pid), gpu_used_bytes()))
    return sorted(results, key=lambda r: r.index), samples, adapter_errors, loaded


async def _compare_alone(client: httpx.AsyncClient, served: Served, cfg: SoakConfig, specs: list[RequestSpec],
                         results: list[RequestResult], adapter_errors: list[str]) -> tuple[list[dict], int]:
    """Send each completed request (or a ``compare_frac`` sample) again, alone; the outputs must be equal."""
    sample = random.Random(cfg.seed + 1)
    completed = [r for r in results
                 if _completed(r) and (cfg.compare_frac >= 1 or sample.random() < cfg.compare_frac)]
    used = sorted({r.model for r in completed} & set(served.adapters))
    for name in used:
        if err := await load_adapter(client, served, name):
            adapter_errors.append(err)
    mismatches = []
    for r in completed:
        alone = await send(client, served, specs[r.index], r.model, cfg.request_timeout_s)
        if alone.status != 200 or alone.error or alone.output != r.output:
            mismatches.append({"index": r.index, "model": r.model, "route": specs[r.index].route,
                               "diverges_at_char": _common_prefix_len(json.dumps(r.output),
                                                                      json.dumps(alone.output)),
                               "soak": r.output, "alone": alone.output,
                               "alone_status": alone.status, "alone_error": alone.error})
    for name in used:
        if err := await unload_adapter(client, served, name):
            adapter_errors.append(err)
    return mismatches, len(completed)


def _common_prefix_len(a: str, b: str) -> int:
    """Where two outputs part (a late divergence after equal text hints at rounding, not a bug)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _completed(r: RequestResult) -> bool:
    return not r.cancelled and r.status == 200 and r.error is None


def _report(cfg: SoakConfig, specs: list[RequestSpec], results: list[RequestResult],
            samples: list[MemorySample], adapter_errors: list[str], mismatches: list[dict], num_compared: int,
            duration_s: float, after_soak: dict[str, float], after_reference: dict[str, float]) -> SoakReport:
    failed = [r for r in results if not r.cancelled and not _completed(r)]
    leaked = {f"{when}:{g}": gauges[g]
              for when, gauges in (("soak", after_soak), ("reference", after_reference))
              for g in IDLE_GAUGES if gauges.get(g, 0.0) != 0}
    by_route: dict[str, int] = {}
    for s in specs:
        key = f"{s.route}{'-stream' if s.stream else ''}"
        by_route[key] = by_route.get(key, 0) + 1
    warmup_done = int(cfg.warmup_frac * cfg.num_requests)
    return SoakReport(
        num_requests=len(results), num_completed=sum(map(_completed, results)),
        num_cancelled=sum(r.cancelled for r in results), num_failed=len(failed),
        num_5xx=sum(1 for r in results if r.status is not None and r.status >= 500),
        num_mismatches=len(mismatches), num_compared=num_compared, duration_s=duration_s,
        requests_per_s=len(results) / duration_s if duration_s else 0.0, by_route=by_route,
        adapter_errors=adapter_errors,
        failures=[{"index": r.index, "model": r.model, "status": r.status, "error": r.error}
                  for r in failed[:20]],
        mismatches=mismatches[:20], gauges_after_soak=after_soak, gauges_after_reference=after_reference,
        leaked=leaked,
        rss_start_mib=samples[0].rss_bytes / MIB if samples else None,
        rss_warm_mib=next((s.rss_bytes / MIB for s in samples if s.num_done >= warmup_done), None),
        rss_end_mib=samples[-1].rss_bytes / MIB if samples else None,
        rss_growth_mib_per_1k=growth_per_1k(samples, "rss_bytes", warmup_done),
        gpu_growth_mib_per_1k=growth_per_1k(samples, "gpu_bytes", warmup_done),
        num_preemptions=after_reference.get("chorus:num_preemptions_total", 0.0),
        max_num_reqs_per_step=after_reference.get("chorus:max_num_reqs_per_step", 0.0))


def print_report(report: SoakReport) -> None:
    def fmt(x: Optional[float], unit: str = "") -> str:
        return "n/a" if x is None else f"{x:.2f}{unit}"

    rows = [("requests", report.num_requests), ("  by route", report.by_route),
            ("completed (200)", report.num_completed),
            ("cancelled (client disconnects)", report.num_cancelled),
            ("failed (not cancelled, not 200)", report.num_failed), ("5xx", report.num_5xx),
            ("compared alone / mismatches", f"{report.num_compared} / {report.num_mismatches}"),
            ("adapter load/unload errors", len(report.adapter_errors)),
            ("duration", fmt(report.duration_s, " s")), ("rate", fmt(report.requests_per_s, " req/s")),
            ("preemptions", int(report.num_preemptions)),
            ("most requests in one step", int(report.max_num_reqs_per_step)),
            ("server RSS start -> warm -> end", f"{fmt(report.rss_start_mib, ' MiB')} -> "
             f"{fmt(report.rss_warm_mib, ' MiB')} -> {fmt(report.rss_end_mib, ' MiB')}"),
            ("RSS growth after warm-up", fmt(report.rss_growth_mib_per_1k, " MiB / 1,000 requests")),
            ("GPU memory growth after warm-up", fmt(report.gpu_growth_mib_per_1k, " MiB / 1,000 requests")),
            ("leaked (idle gauges not 0)", report.leaked or "none"),
            ("verdict", "OK" if report.ok else "FAILED")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for f in report.failures[:5]:
        print("failure:", f)
    for m in report.mismatches[:5]:
        print("mismatch:", m)
    for e in report.adapter_errors[:5]:
        print("adapter error:", e)


# ----------------------------------------------------------------------------------------
# Models and the server process
# ----------------------------------------------------------------------------------------
@dataclass
class SoakModels:
    chat_dir: Path
    adapter_dirs: dict[str, Path]
    whisper: Optional[str] = None
    """--transcription-model value (a directory, or ``default``), or None."""
    tiny: bool = False
    """The tests' tiny random checkpoints (the server gets small budgets to stress them)."""


def build_tiny_models(root: Path, num_adapters: int = 16, audio: bool = True) -> SoakModels:
    """The tests' tiny random LLaVA (chat + images), random adapters for it, and a tiny random Whisper
    (skipped when the real tiny.en tokenizer it copies is not installed)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tests.vision.conftest import build_tiny_llava

    chat_dir = build_tiny_llava(root / "tiny-llava")
    whisper = None
    if audio:
        try:
            from engine.loader.whisper_packages import WhisperModelUnavailable, whisper_model_dir
            whisper_model_dir("tiny.en")
            from tests.audio.whisper_reference import build_tiny_random_whisper
            # A short decoder context: random weights rarely end a window before it fills.
            whisper = str(build_tiny_random_whisper(root, max_target_positions=48))
        except WhisperModelUnavailable:
            whisper = None
    adapters = write_random_adapters(chat_dir, root / "adapters", num_adapters)
    return SoakModels(chat_dir, adapters, whisper, tiny=True)


def write_random_adapters(model_dir: Path, out_dir: Path, num: int, rank: int = 8,
                          seed: int = 0) -> dict[str, Path]:
    """``num`` random PEFT adapters on q_proj and v_proj of a Llama-family (or LLaVA's language) model,
    written from its config.json alone (no weights loaded, so any size works)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    prefix = "base_model.model.model." + ("language_model.layers" if "text_config" in cfg else "layers")
    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    head_dim = text.get("head_dim") or hidden // heads
    kv_heads = text.get("num_key_value_heads", heads)
    outs = {"q_proj": heads * head_dim, "v_proj": kv_heads * head_dim}
    targets = r".*language_model.*\.(q_proj|v_proj)" if "text_config" in cfg else ["q_proj", "v_proj"]
    gen = torch.Generator().manual_seed(seed)
    dirs = {}
    for i in range(num):
        tensors = {}
        for layer in range(text["num_hidden_layers"]):
            for proj, out in outs.items():
                key = f"{prefix}.{layer}.self_attn.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) / math.sqrt(hidden)
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.5
        d = Path(out_dir) / f"soak-lora-{i}"
        d.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "base_model_name_or_path": str(model_dir)}))
        dirs[d.name] = d
    return dirs


def tiny_server_args() -> list[str]:
    """Budgets that put the tiny models under pressure: 39 KV blocks (preemptions), 128-token steps
    (chunked prefill), 8 sequences, 4 adapter slots, an encoder cache of 3 images."""
    return ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "128", "--num-gpu-blocks-override", "40", "--kv-cache-space", "0.05",
            "--max-loras", "4", "--max-lora-rank", "8", "--limit-mm-per-prompt", '{"image": 2}',
            "--max-num-encoder-input-tokens", "32", "--encoder-cache-size", "48"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``chorus serve`` in a subprocess (its log in ``log_path``)."""

    def __init__(self, models: SoakModels, served_name: str, whisper_name: str, extra_args: list[str],
                 log_path: Path, startup_timeout_s: float = 600.0, attempts: int = 3) -> None:
        self.log_path = log_path
        for attempt in range(attempts):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            cmd = [sys.executable, "-m", "engine.cli", "serve", str(models.chat_dir), "--host", "127.0.0.1",
                   "--port", str(self.port), "--served-model-name", served_name, "--enable-lora",
                   "--allow-runtime-lora-updating", "--disable-log-requests", "--disable-uvicorn-access-log",
                   "--uvicorn-log-level", "warning"]
            if models.whisper:
                cmd += ["--transcription-model", models.whisper,
                        "--transcription-served-model-name", whisper_name]
            cmd += (tiny_server_args() if models.tiny else []) + extra_args
            self._log = open(log_path, "w")
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
            try:
                self._wait_ready(startup_timeout_s)
                return
            except RuntimeError:
                # Another process took the free port before the server bound it (it loads first): retry.
                if attempt + 1 == attempts or "address already in use" not in self.log_tail().lower():
                    raise
                self._log.close()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not start in {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def soak_with_server(models: SoakModels, cfg: SoakConfig, work_dir: Path,
                     extra_args: Optional[list[str]] = None,
                     served_name: str = "soak-base", whisper_name: str = "soak-whisper") -> SoakReport:
    """Start ``chorus serve`` on ``models``, run the soak, stop the server."""
    server = ServerProcess(models, served_name, whisper_name, extra_args or [], work_dir / "server.log")
    try:
        served = Served(server.url, served_name, {k: str(v) for k, v in models.adapter_dirs.items()},
                        images=_takes_images(models.chat_dir),
                        whisper_model=whisper_name if models.whisper else None,
                        pid=server.proc.pid)
        report = asyncio.run(run_soak(served, cfg))
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server died during the soak:\n{server.log_tail()}")
        return report
    finally:
        server.stop()


def _takes_images(model_dir: Path) -> bool:
    cfg_path = Path(model_dir) / "config.json"
    return cfg_path.is_file() and "vision_config" in json.loads(cfg_path.read_text())


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    d = SoakConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=d.num_requests)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--disconnect-frac", type=float, default=d.disconnect_frac)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--compare-frac", type=float, default=d.compare_frac,
                   help="Fraction of the completed requests run again alone and compared (default: all).")
    p.add_argument("--model", default=None, help="Chat model directory to serve (default: build the tests' "
                   "tiny random LLaVA); a vision model also gets image requests.")
    p.add_argument("--transcription-model", default=None, help="Whisper model served next to it "
                   "(PATH|default; default with no --model: a tiny random Whisper; 'none': no audio).")
    p.add_argument("--server-args", default="", help="Extra `chorus serve` flags, one string.")
    p.add_argument("--url", default=None, help="Soak a running server instead (started with --enable-lora "
                   "--allow-runtime-lora-updating); with --served-model-name and --adapters-dir.")
    p.add_argument("--served-model-name", default="soak-base")
    p.add_argument("--whisper-name", default=None, help="With --url: the served Whisper model's name.")
    p.add_argument("--adapters-dir", default=None, help="With --url or --model: adapter directories to load "
                   "(default: 16 random ones written for the model).")
    p.add_argument("--num-adapters", type=int, default=16)
    p.add_argument("--server-pid", type=int, default=None, help="With --url: the server's pid, for RSS.")
    p.add_argument("--images", action="store_true", help="With --url: the model takes images.")
    p.add_argument("--work-dir", default=None, help="Where models, adapters and the server log go "
                   "(default: a temp dir, removed afterwards).")
    p.add_argument("--out", default=None, help="Write the report as JSON here.")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    cfg = SoakConfig(num_requests=args.num_requests, concurrency=args.concurrency,
                     disconnect_frac=args.disconnect_frac, seed=args.seed, max_tokens=args.max_tokens,
                     compare_frac=args.compare_frac)
    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="chorus-soak-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        report = _run(args, cfg, work_dir)
    finally:
        if not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
    print_report(report)
    if args.out:
        body = {"config": asdict(cfg), "ok": report.ok, **asdict(report)}
        Path(args.out).write_text(json.dumps(body, indent=2))
    return 0 if report.ok else 1


def _run(args: argparse.Namespace, cfg: SoakConfig, work_dir: Path) -> SoakReport:
    if args.url:
        adapters = ({d.name: str(d) for d in sorted(Path(args.adapters_dir).iterdir()) if d.is_dir()}
                    if args.adapters_dir else {})
        served = Served(args.url.rstrip("/"), args.served_model_name, adapters, images=args.images,
                        whisper_model=args.whisper_name, pid=args.server_pid)
        return asyncio.run(run_soak(served, cfg))
    if args.model is None:
        models = build_tiny_models(work_dir, args.num_adapters, audio=args.transcription_model != "none")
    else:
        adapters = ({d.name: d for d in sorted(Path(args.adapters_dir).iterdir()) if d.is_dir()}
                    if args.adapters_dir else write_random_adapters(Path(args.model), work_dir / "adapters",
                                                                    args.num_adapters))
        whisper = None if args.transcription_model in (None, "none") else args.transcription_model
        models = SoakModels(Path(args.model), adapters, whisper)
    if args.transcription_model not in (None, "none") and args.model is None:
        models.whisper = args.transcription_model
    return soak_with_server(models, cfg, work_dir, shlex.split(args.server_args), args.served_model_name)


if __name__ == "__main__":
    sys.exit(main())
