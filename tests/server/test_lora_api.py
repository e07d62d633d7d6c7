"""Adapters over HTTP with the openai client: --lora-modules (both forms), /v1/models, the `model`
field picking the adapter, runtime load/unload (which really frees), and every error's status."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from engine.core_messages import ListLoRAs
from tests.lora.utils import ALL_TARGETS, build_peft_adapter, edit_adapter_config, peft_greedy, peft_reference_model
from tests.server.conftest import start_server, wait_until

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("http-adapters")
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    paths = {
        "sql": build_peft_adapter(tiny_llama_dir, root / "sql", r=8, lora_alpha=16, target_modules=ALL_TARGETS,
                                  seed=1, base_model=base),
        "chat": build_peft_adapter(tiny_llama_dir, root / "chat", r=32, lora_alpha=16,
                                   target_modules=["q_proj", "v_proj"], seed=2, base_model=base),
        "late": build_peft_adapter(tiny_llama_dir, root / "late", r=4, lora_alpha=8,
                                   target_modules=["gate_proj", "up_proj", "down_proj"], seed=3, base_model=base),
        "huge": build_peft_adapter(tiny_llama_dir, root / "huge", r=64, lora_alpha=8,
                                   target_modules=["q_proj"], seed=4, base_model=base),
        "dora": build_peft_adapter(tiny_llama_dir, root / "dora", r=4, lora_alpha=8,
                                   target_modules=["q_proj"], seed=5, base_model=base),
    }
    edit_adapter_config(paths["dora"], use_dora=True)
    return paths


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapters):
    srv = start_server(
        str(tiny_llama_dir), served_model_name=["tiny-llama"], max_model_len=256,
        lora_modules=[f"sql={adapters['sql']}",
                      json.dumps({"name": "chat", "path": str(adapters["chat"]), "base_model_name": "tiny-llama"})],
        allow_runtime_lora_updating=True, max_loras=2)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def _complete(client, model: str, max_tokens: int = 12) -> list[int]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True}, logprobs=1)
    return out.choices[0].logprobs.tokens, out.choices[0].text


def test_models_lists_base_and_adapters(server, client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny-llama", "sql", "chat"}
    assert cards["sql"].root == str(adapters["sql"]) and cards["sql"].parent == "tiny-llama"
    assert cards["chat"].parent == "tiny-llama"
    # max_lora_rank defaulted to the largest start-up rank (32 > 16).
    assert server.engine_client.engine_config.lora_config.max_lora_rank == 32


def test_each_adapter_answers_through_model_field(server, client, tiny_llama_dir, adapters):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tok.encode(PROMPT)
    pm = peft_reference_model(tiny_llama_dir, {"sql": adapters["sql"], "chat": adapters["chat"]})
    texts = {}
    for model, adapter in [("tiny-llama", None), ("sql", "sql"), ("chat", "chat")]:
        ref = peft_greedy(pm, adapter, ids, 12)
        _, text = _complete(client, model)
        assert text == tok.decode(ref.token_ids, skip_special_tokens=True), model
        texts[model] = text
    assert len(set(texts.values())) == 3  # adapters really change the output


def test_runtime_load_then_unload_really_frees(server, client, adapters):
    url = server.url
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["late"])})
    assert r.status_code == 200, r.text
    assert "late" in {m.id for m in client.models.list().data}
    _, late_text = _complete(client, "late")
    _, base_text = _complete(client, "tiny-llama")
    assert late_text != base_text
    assert "late" in {lr.lora_name for lr in server.call_engine(ListLoRAs())}
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "late")
    # The engine holds no copy any more (host store and slots), once nothing runs on it.
    assert wait_until(lambda: "late" not in {lr.lora_name for lr in server.call_engine(ListLoRAs())})
    assert "late" not in {m.id for m in client.models.list().data}


# A client's lora_path gets one message whatever went wrong (missing, unservable): nothing of the
# server's files (whether a path exists, what an adapter_config.json holds) reaches the client.
@pytest.mark.parametrize("body, status, needle", [
    ({"lora_name": "ghost", "lora_path": "/no/such/dir"}, 400, "could not be loaded from lora_path"),
    ({"lora_name": "dora", "lora_path": "DORA"}, 400, "could not be loaded from lora_path"),
    ({"lora_name": "huge", "lora_path": "HUGE"}, 400, "could not be loaded from lora_path"),
    ({"lora_name": "sql", "lora_path": "SQL"}, 400, "already"),
    ({"lora_name": "", "lora_path": "x"}, 400, "lora_name"),
])
def test_load_errors(server, client, adapters, body, status, needle):
    body = dict(body)
    body["lora_path"] = {"DORA": str(adapters["dora"]), "HUGE": str(adapters["huge"]),
                         "SQL": str(adapters["sql"])}.get(body["lora_path"], body["lora_path"])
    r = httpx.post(server.url + "/v1/load_lora_adapter", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower() and err["code"] == status
    for secret in ("use_dora", "DoRA", "rank", "64", "does not exist"):
        assert secret not in err["message"]
    # The server keeps serving.
    assert _complete(client, "sql", max_tokens=2)[1]


def test_unknown_model_and_unload_unknown(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "no-such-adapter")
    assert "does not exist" in str(e.value)
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert r.status_code == 404


def test_bad_adapter_at_startup_stops_with_message(tiny_llama_dir, adapters):
    with pytest.raises(Exception, match="DoRA"):
        start_server(str(tiny_llama_dir), lora_modules=[f"bad={adapters['dora']}"], max_model_len=128)
