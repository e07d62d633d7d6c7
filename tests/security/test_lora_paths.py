"""Where /v1/load_lora_adapter may read an adapter from (``--allowed-lora-path``), and what its errors say.

The ``lora_path`` of a runtime load is resolved (symlinks and ``..`` followed) and must lie under one of
the flag's directories; every refusal and every failure to load is one 400 (``param: lora_path``) that
tells nothing of the server's files: not whether a path exists, not a field of an adapter_config.json.
Without the flag any path may be loaded (vLLM's behaviour), with the same one-message errors. The
``model`` field never makes the server look at a file: an unknown name is a 404.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from engine.core_messages import ListLoRAs
from engine.server.args import check_serve_args, make_serve_namespace
from tests.lora.utils import build_peft_adapter
from tests.server.conftest import free_port, start_server

MARKER = "MARKER-7f3a9c-adapter-config-field"
"""A value put in the adapter_config.json of every adapter a refused request points at."""


def _mark(adapter_dir: Path, **changes) -> None:
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    cfg.update({"base_model_name_or_path": MARKER, "revision": MARKER, **changes})
    (adapter_dir / "adapter_config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def dirs(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    top = tmp_path_factory.mktemp("lora-paths")
    root, outside = top / "adapters", top / "elsewhere"
    root.mkdir()
    outside.mkdir()
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    good = build_peft_adapter(tiny_llama_dir, root / "good", r=8, lora_alpha=16, target_modules=["q_proj"],
                              seed=1, base_model=base)
    secret = build_peft_adapter(tiny_llama_dir, outside / "secret", r=8, lora_alpha=16, target_modules=["q_proj"],
                                seed=2, base_model=base)
    _mark(secret)
    # Inside the root but unservable, with the marker in the field an error would name.
    bad = build_peft_adapter(tiny_llama_dir, root / "bad", r=8, lora_alpha=16, target_modules=["q_proj"],
                             seed=3, base_model=base)
    _mark(bad, target_modules=[f"{MARKER}_proj"], use_dora=True)
    os.symlink(secret, root / "escape")                 # a link inside the root to an adapter outside
    return {"root": root, "outside": outside, "good": good, "secret": secret, "bad": bad}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, dirs):
    srv = start_server(str(tiny_llama_dir), engine_kwargs={"enable_lora": True, "max_lora_rank": 8},
                       served_model_name=["tiny"], max_model_len=128, allow_runtime_lora_updating=True,
                       allowed_lora_path=[str(dirs["root"])])
    _warm(srv)
    yield srv
    srv.stop()


def _warm(srv) -> None:
    """One base request: binds the engine client to the server's loop (``call_engine`` from tests)."""
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text


def _load(url: str, name: str, path: str) -> httpx.Response:
    return httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=30)


def _refused(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "lora_path" and err["code"] == 400
    assert "could not be loaded from lora_path" in err["message"]
    assert MARKER not in r.text and "q_proj" not in r.text and "DoRA" not in r.text
    return r.text


REFUSED = {
    "dotdot_to_elsewhere": lambda d: str(d["root"] / ".." / "elsewhere" / "secret"),
    "absolute_outside": lambda d: str(d["secret"]),
    "symlink_inside_to_outside": lambda d: str(d["root"] / "escape"),
    "etc": lambda d: "/etc",
    "etc_passwd": lambda d: "/etc/passwd",
    "missing_under_root": lambda d: str(d["root"] / "nope"),
    "missing_outside": lambda d: str(d["outside"] / "nope"),
    "unservable_under_root": lambda d: str(d["bad"]),
    "root_itself": lambda d: str(d["root"]),
    "relative_escape": lambda d: os.path.relpath(d["secret"]),
    "nul_byte": lambda d: str(d["good"]) + "\x00x",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_lora_paths_are_one_400_that_reveals_nothing(server, dirs, case):
    _refused(_load(server.url, "probe", REFUSED[case](dirs)))
    assert "probe" not in {lr.lora_name for lr in server.call_engine(ListLoRAs())}
    assert "probe" not in {m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]}


def test_existing_and_missing_paths_outside_get_the_same_bytes(server, dirs):
    exists = _refused(_load(server.url, "probe", str(dirs["secret"])))
    missing = _refused(_load(server.url, "probe", str(dirs["outside"] / "nope")))
    etc = _refused(_load(server.url, "probe", "/etc"))
    assert exists == missing == etc


def test_an_adapter_under_the_root_loads_and_serves(server, dirs):
    # Through a path with '..' that stays inside the root: resolved, then allowed.
    r = _load(server.url, "good", str(dirs["root"] / "bad" / ".." / "good"))
    assert r.status_code == 200, r.text
    assert "good" in {lr.lora_name for lr in server.call_engine(ListLoRAs())}
    out = httpx.post(server.url + "/v1/completions", json={"model": "good", "prompt": "Hello", "max_tokens": 3,
                                                           "ignore_eos": True}, timeout=30)
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3


def test_unknown_model_is_404_without_looking_at_files(server, dirs, monkeypatch):
    """A ``model`` naming no served model nor loaded adapter is a 404, whatever it names."""
    import lora.peft_adapter as peft_adapter

    def no_reads(*args, **kwargs):
        raise AssertionError("the model field made the server read an adapter")

    monkeypatch.setattr(peft_adapter, "load_peft_adapter", no_reads)
    for model in (str(dirs["good"]), "/etc", "../elsewhere/secret", str(dirs["secret"])):
        r = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1},
                       timeout=30)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["param"] == "model" and MARKER not in r.text


# ------------------------------------------------------------------------------------------
# Without --allowed-lora-path: any path (vLLM's), still one message that reveals nothing
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def open_server(tiny_llama_dir):
    srv = start_server(str(tiny_llama_dir), engine_kwargs={"enable_lora": True, "max_lora_rank": 8},
                       served_model_name=["tiny"], max_model_len=128, allow_runtime_lora_updating=True)
    yield srv
    srv.stop()


def test_without_the_flag_errors_still_reveal_nothing(open_server, dirs):
    missing = _refused(_load(open_server.url, "probe", str(dirs["outside"] / "nope")))
    not_adapter = _refused(_load(open_server.url, "probe", "/etc"))
    unservable = _refused(_load(open_server.url, "probe", str(dirs["bad"])))
    assert missing == not_adapter == unservable
    r = _load(open_server.url, "secret", str(dirs["secret"]))     # no roots: any readable adapter
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------------------
# Start-up
# ------------------------------------------------------------------------------------------
def test_check_serve_args_names_the_flag_for_a_missing_or_file_dir(tmp_path):
    check_serve_args(make_serve_namespace(allowed_lora_path=[str(tmp_path)]))   # fine
    for bad in (tmp_path / "missing", tmp_path / "file"):
        if bad.name == "file":
            bad.write_text("x")
        with pytest.raises(ValueError, match="--allowed-lora-path") as e:
            check_serve_args(make_serve_namespace(allowed_lora_path=[str(tmp_path), str(bad)]))
        assert str(bad) in str(e.value)


def test_serve_with_a_missing_allowed_lora_path_stops_with_one_line(tiny_llama_dir, tmp_path, capfd):
    """``chorus serve``'s entry point in this process (tests/server/test_startup_errors.py starts the real
    console script): exit status 2 and one line naming the flag."""
    from engine.cli import main
    missing = tmp_path / "no-such-adapters"
    code = main(["serve", str(tiny_llama_dir), "--host", "127.0.0.1", "--port", str(free_port()),
                 "--allow-runtime-lora-updating", "--allowed-lora-path", str(missing)])
    proc = subprocess.CompletedProcess([], code, *capfd.readouterr())
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("chorus serve: error: --allowed-lora-path"), proc.stderr[-2000:]
    assert str(missing) in lines[0] and "Serving" not in proc.stderr + proc.stdout
