"""Every request field that names a file or a URL, as one table: none makes the server open a file it was
not configured to read, and no response carries a byte of one.

The fields: a request's ``chat_template`` (on /tokenize and chat; also smuggled in ``chat_template_kwargs``),
an ``image_url`` as ``file://`` URL (no ``--allowed-local-media-path``), as a plain path and as a
``file://`` URL that climbs out of the allowed directory, the ``model`` field naming an adapter directory,
and ``lora_path`` of /v1/load_lora_adapter outside ``--allowed-lora-path`` (directly, through ``..`` and
through a symlink). A Python audit hook records every file the server process opens under the secret
directory while each request runs: the list must stay empty.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import httpx
import pytest

from tests.security.test_admission import small_png
from tests.server.conftest import start_server
from tests.vision.conftest import build_tiny_llava

KEY = "sk-file-fields"
AUTH = {"Authorization": f"Bearer {KEY}"}
MARKER = "MARKER-5d1e0b-secret-file"
"""Written into every secret file: it must appear in no response."""

_opened_under: list[str] = []
"""Paths opened under ``_watched[0]`` since the last reset (the audit hook appends to it)."""
_watched: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _watched and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if path.startswith(_watched[0]) or os.path.realpath(path).startswith(_watched[0]):
            _opened_under.append(path)


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> Path:
    """A directory the server was not told about: a text file, an image, an adapter directory."""
    top = tmp_path_factory.mktemp("secret")
    (top / "secret.txt").write_text(f"{MARKER}\nroot:x:0:0:root:/root:/bin/bash\n")
    (top / "secret.png").write_bytes(small_png())
    adapter = top / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                             "target_modules": ["q_proj"],
                                                             "base_model_name_or_path": MARKER}))
    if not _watched:
        sys.addaudithook(_audit)   # process-wide and permanent: checks one prefix per open
    _watched[:] = [os.path.realpath(top)]
    return top


@pytest.fixture(scope="module")
def allowed(tmp_path_factory, secret) -> dict[str, Path]:
    top = tmp_path_factory.mktemp("allowed")
    media, adapters = top / "media", top / "adapters"
    media.mkdir()
    adapters.mkdir()
    os.symlink(secret / "adapter", adapters / "link")        # inside the root, pointing out of it
    os.symlink(secret / "secret.png", media / "link.png")
    return {"media": media, "adapters": adapters}


@pytest.fixture(scope="module")
def server(tmp_path_factory, allowed):
    srv = start_server(str(build_tiny_llava(tmp_path_factory.mktemp("llava"))), served_model_name=["llava"],
                       engine_kwargs={"enable_lora": True, "max_lora_rank": 8}, dtype="float32", device="cpu",
                       max_model_len=256, api_key=KEY, allow_runtime_lora_updating=True,
                       allowed_lora_path=[str(allowed["adapters"])],
                       allowed_local_media_path=str(allowed["media"]))
    yield srv
    srv.stop()


def _chat(**extra) -> dict:
    return {"model": "llava", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **extra}


def _image_chat(url: str) -> dict:
    return {"model": "llava", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]}]}


# (route, body from (secret dir, allowed dirs), status, param)
CASES = {
    "tokenize chat_template path": (
        "/tokenize", lambda s, a: _chat(chat_template=str(s / "secret.txt")), 400, "chat_template"),
    "chat chat_template path": (
        "/v1/chat/completions", lambda s, a: _chat(chat_template=str(s / "secret.txt")), 400, "chat_template"),
    "chat_template in chat_template_kwargs": (
        "/v1/chat/completions", lambda s, a: _chat(chat_template_kwargs={"chat_template": str(s / "secret.txt")}),
        400, "chat_template_kwargs"),
    "image file:// outside the media dir": (
        "/v1/chat/completions", lambda s, a: _image_chat(f"file://{s / 'secret.png'}"), 400, "messages"),
    "image file:// climbing out with ..": (
        "/v1/chat/completions", lambda s, a: _image_chat(f"file://{a['media']}/../../{s.parent.name}/{s.name}/secret.png"),
        400, "messages"),
    "image file:// through a symlink": (
        "/v1/chat/completions", lambda s, a: _image_chat(f"file://{a['media'] / 'link.png'}"), 400, "messages"),
    "image as a plain path": (
        "/v1/chat/completions", lambda s, a: _image_chat(str(s / "secret.png")), 400, "messages"),
    "model naming an adapter directory": (
        "/v1/completions", lambda s, a: {"model": str(s / "adapter"), "prompt": "hi", "max_tokens": 2}, 404, "model"),
    "lora_path outside the roots": (
        "/v1/load_lora_adapter", lambda s, a: {"lora_name": "x1", "lora_path": str(s / "adapter")}, 400, "lora_path"),
    "lora_path climbing out with ..": (
        "/v1/load_lora_adapter",
        lambda s, a: {"lora_name": "x2", "lora_path": f"{a['adapters']}/../../{s.parent.name}/{s.name}/adapter"},
        400, "lora_path"),
    "lora_path through a symlink": (
        "/v1/load_lora_adapter", lambda s, a: {"lora_name": "x3", "lora_path": str(a["adapters"] / "link")},
        400, "lora_path"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_field_reads_a_file_the_server_was_not_given(server, secret, allowed, case):
    route, body, status, param = CASES[case]
    _opened_under.clear()
    r = httpx.post(server.url + route, json=body(secret, allowed), headers=AUTH, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert MARKER not in r.text and "root:x:0:0" not in r.text
    assert _opened_under == [], f"{case}: the server opened {_opened_under}"


def test_the_table_reads_what_the_server_was_given(server, secret, allowed):
    """The same watch sees a file the server may read (an image under --allowed-local-media-path): the
    table above cannot pass by not watching."""
    (allowed["media"] / "ok.png").write_bytes(small_png(1))
    _watched.append(_watched[0])
    _watched[0] = os.path.realpath(allowed["media"])
    try:
        _opened_under.clear()
        r = httpx.post(server.url + "/v1/chat/completions", json=_image_chat(f"file://{allowed['media'] / 'ok.png'}"),
                       headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        assert any(p.endswith("ok.png") for p in _opened_under), _opened_under
    finally:
        _watched[0] = _watched.pop()
