"""Default step limits (vLLM's rule): large GPUs get more requests per step, CPU keeps 256 / 8192."""

from __future__ import annotations

import argparse

import pytest

import engine.arg_utils as arg_utils
from engine.arg_utils import EngineArgs, batch_defaults
from engine.server.args import use_engine_process


def test_cpu_defaults():
    assert batch_defaults("cpu", "llm") == (8192, 256)
    assert batch_defaults("cpu", "server") == (8192, 256)
    sc = EngineArgs(device="cpu").create_engine_config(max_model_len=2048).scheduler_config
    assert (sc.max_num_batched_tokens, sc.max_num_seqs) == (8192, 256)


def test_large_gpu_defaults(monkeypatch):
    monkeypatch.setattr(arg_utils, "_is_large_gpu", lambda device: True)
    assert batch_defaults("auto", "llm") == (16384, 1024)
    assert batch_defaults("auto", "server") == (8192, 1024)
    sc = EngineArgs().create_engine_config(max_model_len=2048).scheduler_config
    assert (sc.max_num_batched_tokens, sc.max_num_seqs) == (16384, 1024)
    sc = EngineArgs(usage_context="server").create_engine_config(max_model_len=2048).scheduler_config
    assert (sc.max_num_batched_tokens, sc.max_num_seqs) == (8192, 1024)
    # Explicit values win; a long context still fits one step.
    sc = EngineArgs(max_num_seqs=64, max_num_batched_tokens=4096).create_engine_config(2048).scheduler_config
    assert (sc.max_num_batched_tokens, sc.max_num_seqs) == (4096, 64)
    sc = EngineArgs().create_engine_config(max_model_len=32768).scheduler_config
    assert sc.max_num_batched_tokens == 32768


def test_bad_usage_context():
    with pytest.raises(ValueError, match="usage_context"):
        batch_defaults("cpu", "batch")


def test_engine_process_default_follows_the_device():
    ns = argparse.Namespace
    assert use_engine_process(ns(engine_process=None, device="cpu")) is False
    assert use_engine_process(ns(engine_process=True, device="cpu")) is True
    assert use_engine_process(ns(engine_process=False, device="auto")) is False
