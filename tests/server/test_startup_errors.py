"""``chorus serve`` as a user runs it, when it cannot start: every bad setting stops it with exit status 2
and one line on stderr naming the flag and the fix, no traceback, and never after the "Serving" line.
A good start logs "Serving" only once the adapters are loaded, and request heads have a deadline.

One module fixture runs every case: two as real processes (in parallel), the others in this process.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from engine.errors import EngineStartupError
from engine.server.app import EXIT_CONFIG_ERROR, EXIT_STARTUP_FAILURE, startup_error
from engine.server.args import name_the_flag
from tests.lora.utils import build_peft_adapter
from tests.server.conftest import free_port
from tests.server.test_cli import REPO, _spawn, _wait_healthy, chorus_cmd

ERROR_PREFIX = "chorus serve: error: "


def _adapter_dir(root: Path, name: str, config: str, weights: bytes = b"x") -> str:
    """A directory with this adapter_config.json text and weights file bytes (no real tensors)."""
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text(config)
    (d / "adapter_model.safetensors").write_bytes(weights)
    return str(d)


GOOD_CONFIG = json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "peft_type": "LORA"})
RANK_64_CONFIG = json.dumps({"r": 64, "lora_alpha": 16, "target_modules": ["q_proj"], "peft_type": "LORA"})

# case -> (serve arguments, words the error line must hold); "M" is the tiny model, "PORT_IN_USE" a port
# another socket listens on, "ADAPTERS" the fixture's adapter folder.
CASES = {
    "lora_missing_path": (["M", "--lora-modules", "sql=ADAPTERS/nope"],
                          ["--lora-modules sql=", "is not a directory", "PEFT adapter directory"]),
    "lora_no_config": (["M", "--lora-modules", "sql=ADAPTERS/empty"],
                       ["--lora-modules sql=", "no adapter_config.json in", "give a PEFT adapter directory"]),
    "lora_corrupt_config": (["M", "--lora-modules", "sql=ADAPTERS/corrupt"],
                            ["--lora-modules sql=", "adapter_config.json is not valid JSON",
                             "line 2 column 1"]),
    "lora_rank_over_max": (["M", "--lora-modules", "sql=ADAPTERS/rank64", "--max-lora-rank", "16"],
                           ["--lora-modules sql=", "rank 64", "raise --max-lora-rank to 64"]),
    "lora_without_name": (["M", "--lora-modules", "ADAPTERS/rank64"],
                          ["--lora-modules", "no adapter name", "NAME=PATH"]),
    "lora_corrupt_weights": (["M", "--lora-modules", "sql=ADAPTERS/badweights"],   # after the model loads
                             ["--lora-modules sql=", "adapter_model.safetensors is not a valid weights"]),
    "bad_model_path": (["/no/such/model"], ["/no/such/model", "does not exist", "--model"]),
    "bad_model_path_engine_process": (["/no/such/model", "--engine-process"], ["does not exist", "--model"]),
    "bad_dtype": (["M", "--dtype", "float64"], ["--dtype", "invalid choice", "float32"]),
    "bad_config_value": (["M", "--max-num-seqs", "0"], ["--max-num-seqs", "must be >= 1"]),
    "port_in_use": (["M", "--port", "PORT_IN_USE"], ["--port", "already in use", "another --port"]),
}


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama_dir) -> Path:
    root = tmp_path_factory.mktemp("startup-adapters")
    (root / "empty").mkdir()
    _adapter_dir(root, "corrupt", '{"r": 8,\n')
    _adapter_dir(root, "rank64", RANK_64_CONFIG)
    _adapter_dir(root, "badweights", GOOD_CONFIG, weights=b"not a safetensors file")
    build_peft_adapter(tiny_llama_dir, root / "good", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                       seed=0)
    return root


@pytest.fixture(scope="module")
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# This one starts as a real ``chorus serve`` process (the console script, its stderr as a user sees it,
# its engine process's too), beside the others, which run ``engine.cli.main`` in this process (same parser,
# same ``run_server``, fd-level capture) so that they do not each pay Python's and torch's imports.
SUBPROCESS_CASES = ("bad_model_path_engine_process",)


@contextlib.contextmanager
def _captured(tmp: Path) -> Iterator[Run]:
    """What this process (and a child it starts) writes to stdout/stderr and logs, into the Run."""
    run = Run(-1, "", "")
    py_out, py_err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(py_out)
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    files = {fd: open(tmp / f"fd{fd}", "w+") for fd in (1, 2)}
    for fd, f in files.items():
        os.dup2(f.fileno(), fd)
    logging.getLogger().addHandler(handler)
    try:
        with contextlib.redirect_stdout(py_out), contextlib.redirect_stderr(py_err):
            yield run
    finally:
        logging.getLogger().removeHandler(handler)
        for fd, f in files.items():
            os.dup2(saved[fd], fd)
            os.close(saved[fd])
            f.seek(0)
        run.stdout = py_out.getvalue() + files[1].read()
        run.stderr = py_err.getvalue() + files[2].read()
        for f in files.values():
            f.close()


def _argv(argv: list[str], names: dict[str, str], adapters: Path) -> list[str]:
    argv = [names.get(a, a.replace("ADAPTERS", str(adapters))) for a in argv]
    port_args = [] if "--port" in argv else ["--port", str(free_port())]
    return ["serve", *argv, "--host", "127.0.0.1", *port_args, "--max-model-len", "256"]


@pytest.fixture(scope="module")
def runs(tiny_llama_dir, adapters, busy_port, tmp_path_factory) -> dict[str, Run]:
    """Every case (and --debug on one): its exit status and outputs."""
    from engine.cli import main
    procs = {}
    cases = {**CASES, "debug": (["M", "--lora-modules", "sql=ADAPTERS/nope", "--debug"], [])}
    names = {"M": str(tiny_llama_dir), "PORT_IN_USE": str(busy_port)}
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    for case in SUBPROCESS_CASES:
        procs[case] = subprocess.Popen([*chorus_cmd(), *_argv(cases[case][0], names, adapters)],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                       env=env)
    out = {}
    for case, (argv, _) in cases.items():
        if case in SUBPROCESS_CASES:
            continue
        with _captured(tmp_path_factory.mktemp(case)) as run:
            try:
                run.returncode = main(_argv(argv, names, adapters))
            except SystemExit as e:   # argparse
                run.returncode = e.code
        out[case] = run
    for case, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
        out[case] = Run(proc.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_setting_stops_serve_with_one_line(runs, case):
    run, words = runs[case], CASES[case][1]
    lines = run.stderr.strip().splitlines()
    assert run.returncode == EXIT_CONFIG_ERROR, (run.returncode, run.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), run.stderr[-2000:]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert "Traceback" not in run.stderr + run.stdout
    assert "Serving" not in run.stderr + run.stdout


def test_debug_shows_the_traceback_then_the_line(runs):
    run = runs["debug"]
    assert run.returncode == EXIT_CONFIG_ERROR
    assert "Traceback (most recent call last)" in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(ERROR_PREFIX + "--lora-modules sql=") and "is not a directory" in last


def test_serving_is_logged_after_the_adapters_load_and_heads_have_a_deadline(tiny_llama_dir, adapters):
    """A good start: "Serving" after the adapter is in the engine; a client that sends no head, or half
    of one, gets a 408 and the connection closes after --slow-client-timeout."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _spawn([str(tiny_llama_dir), "--max-model-len", "256", "--lora-modules",
                   f"good={adapters / 'good'}", "--slow-client-timeout", "1"], port)
    try:
        _wait_healthy(proc, url, 120)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]][-1] == "good"
        silent, trickle = (socket.create_connection(("127.0.0.1", port)) for _ in range(2))
        trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        t0 = time.monotonic()
        for sock in (silent, trickle):
            sock.settimeout(30)
            reply = _read_until_closed(sock)
            assert reply.startswith(b"HTTP/1.1 408 ") and b'"code": 408' in reply, reply
        assert time.monotonic() - t0 < 20
        # A keep-alive client that is quick stays served.
        with httpx.Client(base_url=url) as client:
            assert client.get("/health").status_code == 200 and client.get("/health").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    output = proc.stdout.read()
    serving = output.index(f"Serving {tiny_llama_dir} on http://127.0.0.1:{port}")
    assert output.index("Loaded LoRA adapter 'good'") < serving


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return data


# ------------------------------------------------------------------------------------------
# The classification, in process
# ------------------------------------------------------------------------------------------
def test_engine_process_errors_keep_their_kind():
    config = startup_error(EngineStartupError("The engine failed to start: ValueError: max_num_seqs=0 must "
                                              "be >= 1.\nTraceback (most recent call last):\n  ..."))
    assert str(config) == "--max-num-seqs: max_num_seqs=0 must be >= 1."
    assert config.exit_code == EXIT_CONFIG_ERROR
    bug = startup_error(EngineStartupError("The engine failed to start: RuntimeError: boom\nTraceback ..."))
    assert bug.exit_code == EXIT_STARTUP_FAILURE and str(bug).startswith("RuntimeError: boom")
    assert "\n" not in str(startup_error(ValueError("two\nlines")))
    assert startup_error(KeyError("x")).exit_code == EXIT_STARTUP_FAILURE


def test_name_the_flag():
    assert name_the_flag("block_size=3 must be a power of two (e.g. 16).").startswith("--block-size: ")
    assert name_the_flag("--port 1: in use") == "--port 1: in use"
    assert name_the_flag("usage_context='x': use llm") == "usage_context='x': use llm"   # not a serve flag
