"""``--lora-dir``: adapters resolved by name on first use, through the real server (openai client and
httpx). A name found in DIR answers as the same adapter loaded explicitly; an unknown name is a 404, a
broken directory a 400 that leaves nothing registered; names that would leave DIR (``..``, '/',
absolute paths, a symlink pointing outside) never load the adapter that lies outside; ``/v1/models``
lists DIR's names only with ``?all=true``, and without loading them."""

from __future__ import annotations

import os
import shutil

import httpx
import openai
import pytest
import torch

from engine.core_messages import ListLoRAs
from engine.server.lora_resolver import FilesystemLoRAResolver, LoRAResolver, is_plain_name
from tests.lora.utils import build_peft_adapter
from tests.server.conftest import start_server

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def layout(tiny_llama_dir, tmp_path_factory):
    """root/loras (the --lora-dir): alpha, beta (valid), broken (no adapter_config.json), badweights
    (garbage weights), nested/inner (valid, one level down), escape -> root/secret (a valid adapter
    outside DIR); root/explicit: a copy of alpha for /v1/load_lora_adapter."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora-dir")
    loras = root / "loras"
    loras.mkdir()
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    build_peft_adapter(tiny_llama_dir, loras / "alpha", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                       seed=11, base_model=base)
    build_peft_adapter(tiny_llama_dir, loras / "beta", r=4, lora_alpha=8, target_modules=["o_proj"],
                       seed=12, base_model=base)
    shutil.copytree(loras / "alpha", root / "explicit")
    build_peft_adapter(tiny_llama_dir, root / "secret", r=8, lora_alpha=16, target_modules=["q_proj"],
                       seed=13, base_model=base)
    (loras / "broken").mkdir()
    (loras / "broken" / "README").write_text("not an adapter")
    shutil.copytree(loras / "alpha", loras / "badweights")
    (loras / "badweights" / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 16)
    shutil.copytree(loras / "beta", loras / "nested" / "inner")
    shutil.copytree(loras / "beta", loras / "gamma")
    os.symlink(root / "secret", loras / "escape")
    return {"root": root, "loras": loras}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, layout):
    srv = start_server(str(tiny_llama_dir), served_model_name=["tiny-llama"], max_model_len=256,
                       lora_dir=[str(layout["loras"])], allow_runtime_lora_updating=True, max_loras=2)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def _greedy(client, model: str, max_tokens: int = 12) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def _engine_adapters(server) -> set[str]:
    return {lr.lora_name for lr in server.call_engine(ListLoRAs())}


def _registered(server) -> set[str]:
    return set(server.app.state.serving.models.lora_requests)


def test_models_lists_dir_only_when_asked_without_loading(server, client):
    assert _greedy(client, "tiny-llama", max_tokens=1) is not None   # starts the engine loop
    plain = {m["id"] for m in httpx.get(server.base_url + "/models").json()["data"]}
    assert plain == {"tiny-llama"}
    every = {m["id"] for m in httpx.get(server.base_url + "/models", params={"all": "true"}).json()["data"]}
    # Valid directories (and the outside symlink, which resolves to nothing) only.
    assert {"alpha", "beta", "badweights"} <= every
    assert not every & {"broken", "escape", "nested", "inner", "nested/inner"}
    assert "tiny-llama" in every
    assert _registered(server).isdisjoint({"alpha", "beta", "badweights"})
    assert _engine_adapters(server).isdisjoint({"alpha", "beta", "badweights"})


def test_resolved_adapter_equals_explicit_load(server, client, layout):
    base = _greedy(client, "tiny-llama")
    resolved = _greedy(client, "alpha")
    assert "alpha" in _registered(server) and "alpha" in _engine_adapters(server)
    r = httpx.post(server.url + "/v1/load_lora_adapter",
                   json={"lora_name": "alpha-explicit", "lora_path": str(layout["root"] / "explicit")})
    assert r.status_code == 200, r.text
    assert _greedy(client, "alpha-explicit") == resolved != base
    # Second use: already registered, same answer; now listed by plain /v1/models like a runtime load.
    assert _greedy(client, "alpha") == resolved
    cards = {m.id: m for m in client.models.list().data}
    assert cards["alpha"].parent == "tiny-llama"
    assert os.path.realpath(cards["alpha"].root) == os.path.realpath(layout["loras"] / "alpha")
    # Chat and tokenize resolve too.
    chat = client.chat.completions.create(model="beta", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, temperature=0)
    assert chat.model == "beta"
    # It unloads like one loaded explicitly, and resolves again afterwards.
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "alpha"}).status_code == 200
    assert "alpha" not in _registered(server)
    assert _greedy(client, "alpha") == resolved


def test_unknown_name_is_404(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        _greedy(client, "no-such-adapter")
    assert "does not exist" in str(e.value)
    body = httpx.post(server.base_url + "/completions", json={"model": "ghost", "prompt": "x"}).json()
    assert body["error"]["code"] == 404 and body["error"]["param"] == "model"


@pytest.mark.parametrize("name", ["broken", "badweights"])
def test_broken_dir_is_400_with_nothing_held(server, client, name, layout):
    r = httpx.post(server.base_url + "/completions", json={"model": name, "prompt": "x", "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and "could not be loaded" in err["message"]
    assert str(layout["loras"]) not in err["message"] and "adapter_config" not in err["message"]
    assert name not in _registered(server) and name not in _engine_adapters(server)
    assert name not in {m.id for m in client.models.list().data}
    # The server keeps serving.
    assert _greedy(client, "tiny-llama", max_tokens=2)


def test_traversal_never_loads_outside(server, client, layout):
    secret = layout["root"] / "secret"
    names = ["../secret", "..", ".", "nested/inner", "%2e%2e", "%2e%2e/secret", str(secret),
             str(layout["loras"] / "alpha"), "escape", "..\\secret", "./alpha", "alpha/", "a\x00b",
             "nested/../alpha", ".hidden"]
    for name in names:
        r = httpx.post(server.base_url + "/completions", json={"model": name, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 404, (name, r.status_code, r.text)
    # The outside adapter would load (it is valid): it never did, under any name.
    held = _registered(server) | _engine_adapters(server)
    assert not held & set(names)
    models = server.app.state.serving.models
    assert all(os.path.realpath(lr.lora_path) != os.path.realpath(secret) for lr in models.lora_requests.values())
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "secret-check", "lora_path": str(secret)})
    assert r.status_code == 200   # (control: it is a loadable adapter)
    httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "secret-check"})


def test_concurrent_first_uses_load_once(server, client):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda _: _greedy(client, "gamma", max_tokens=4), range(4)))
    assert len(set(texts)) == 1
    assert "gamma" in _registered(server) and "gamma" in _engine_adapters(server)


def test_resolver_unit(layout, tmp_path):
    resolver = FilesystemLoRAResolver(str(layout["loras"]))
    assert isinstance(resolver, LoRAResolver)
    assert resolver.resolve("beta") == os.path.realpath(layout["loras"] / "beta")
    for name in ["../secret", "escape", "nested/inner", "", "..", "/etc", "x" * 300, None]:
        assert resolver.resolve(name) is None, name
    # A symlink inside DIR to another directory inside DIR is fine (it stays under DIR).
    assert not is_plain_name("a/b") and is_plain_name("sql-v2.1")
    with pytest.raises(ValueError, match="--lora-dir"):
        FilesystemLoRAResolver(str(tmp_path / "missing"))


def test_cli_flag_parses_repeatable():
    from engine.server.args import engine_kwargs, make_serve_namespace

    ns = make_serve_namespace()
    assert ns.lora_dir is None
    import argparse

    from engine.server.args import add_serve_args
    ns = add_serve_args(argparse.ArgumentParser()).parse_args(["--lora-dir", "/a", "--lora-dir", "/b"])
    assert ns.lora_dir == ["/a", "/b"]
    assert engine_kwargs(ns)["enable_lora"] is True
