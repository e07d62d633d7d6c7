"""benchmarks/serve_media.py end to end on CPU (smoke): ``chorus serve`` on the tiny LLaVA and the tiny random
Whisper, two bursts of a few requests from two client processes, the offline side in its own process (image)
or run first in this process and given by ``--offline-json`` (audio); every request answered, served / offline
rates for both bursts in the JSON."""

from __future__ import annotations

import json
import socket

import pytest

from tests.audio.whisper_reference import build_tiny_random_whisper
from tests.benchmark_module import load_benchmark
from tests.vision.conftest import build_tiny_llava


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind", ["image", "audio"])
def test_two_bursts_served_and_offline(kind, tmp_path):
    bench = load_benchmark("serve_media.py", "bench_serve_media_unit")
    if kind == "image":
        model = build_tiny_llava(tmp_path / "llava")
        extra = ["--image-size", "64x48", "--max-tokens", "3", "--max-model-len", "256"]
    else:
        model = build_tiny_random_whisper(tmp_path / "whisper", max_target_positions=24)   # short transcripts
        extra = ["--offline-json", str(tmp_path / "offline.json")]
    out = tmp_path / "out.json"
    argv = ["--kind", kind, "--model", str(model), "--device", "cpu", "--dtype", "float32",
            "--num-requests", "3", "--max-num-seqs", "4", *extra]
    if kind == "audio":   # the offline side in this process: one process fewer paying the imports
        offline = bench.main([*argv, "--offline-only", "--out", str(tmp_path / "offline.json")])["offline"]
    s = bench.main([*argv, "--num-clients", "2", "--port", str(_free_port()), "--start-timeout-s", "120",
                    "--out", str(out)])
    assert json.loads(out.read_text()) == s
    if kind == "audio":
        assert s["offline"] == offline
    for name in ("first", "second"):
        assert s["served"][name]["ok"] == 3 and s["offline"][name]["ok"] == 3
        assert s["served"][name]["rate"] > 0 and s["offline"][name]["rate"] > 0
        assert s["ratio"][name] == pytest.approx(s["served"][name]["rate"] / s["offline"][name]["rate"])
    if kind == "image":
        assert s["served"]["first"]["output_tokens"] == 9 == s["offline"]["second"]["output_tokens"]
    else:
        assert s["served"]["second"]["audio_s"] == 90.0
