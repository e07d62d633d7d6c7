"""Turn the user's ``model`` / ``tokenizer`` strings into a checkpoint on local disk.

Accepted forms of ``model`` (first match wins):
  1. ``None`` -> the default model (SmolLM2-135M-Instruct GGUF, see ``default_model.py``);
  2. an existing ``.gguf`` file -> kind "gguf";
  3. an existing CTranslate2 (faster-whisper) Whisper directory -> kind "ct2"; else one with
     ``config.json`` -> kind "hf";
  4. an existing directory holding exactly one ``.gguf`` file -> kind "gguf";
  5. a missing path that looks like a hub id ``org/name`` -> ``huggingface_hub.snapshot_download``,
     then rules 3-4 on the downloaded snapshot.
Anything else raises ``ValueError`` naming the field to fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# "org/name": one slash, hub-legal characters, not starting like a filesystem path.
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")

# Seconds huggingface_hub waits for the hub's metadata reply before giving up.
HUB_ETAG_TIMEOUT_S = 5.0

# Files never needed to run a PyTorch checkpoint; skipped so a hub download stays small.
# NOTE: ``*.gguf`` is skipped too: GGUF repos hold many quantizations (GBs); download the one
# file you want and pass its path instead.
_HUB_IGNORE_PATTERNS = ["*.h5", "*.msgpack", "*.onnx", "*.onnx_data", "*.ot", "*.tflite", "*.gguf",
                        "*.mlmodel", "*.pth", "original/*"]


@dataclass
class ResolvedModel:
    """A model located on local disk, ready for ``load_config`` / ``iter_weights`` / ``load_tokenizer``."""

    kind: str
    """"hf" (a directory with config.json and weights), "gguf" (a single .gguf file) or "ct2" (a
    faster-whisper / CTranslate2 Whisper directory: model.bin, config.json, tokenizer.json, vocabulary)."""
    path: Path
    """The checkpoint directory (kind "hf") or the .gguf file (kind "gguf"); absolute."""
    tokenizer_path: Optional[Path]
    """An explicit tokenizer directory (the ``tokenizer`` setting), or None to use the model's own."""
    model_arg: Optional[str] = None
    """The ``model`` string as the user gave it (None for the default model); for messages and names."""
    is_default: bool = False
    """True when ``model`` was None and the default SmolLM2-135M-Instruct was picked."""


def resolve_model(model: Optional[str], tokenizer: Optional[str] = None) -> ResolvedModel:
    """Locate ``model`` (and optionally ``tokenizer``) on local disk.

    Args:
        model: a checkpoint directory, a .gguf file, a directory with one .gguf, a hub id, or None
            for the default model.
        tokenizer: a tokenizer directory or hub id overriding the model's tokenizer, or None.

    Returns:
        The resolved model; nothing is loaded or converted yet.

    Raises:
        ValueError: the path does not exist, holds no checkpoint, or the hub id cannot be fetched.
    """
    tokenizer_path = _resolve_tokenizer(tokenizer) if tokenizer else None
    if model is None:
        from engine.loader.default_model import default_model_path

        return ResolvedModel(kind="gguf", path=default_model_path(), tokenizer_path=tokenizer_path,
                             model_arg=None, is_default=True)
    local = Path(model).expanduser()
    if not local.exists():
        if not looks_like_hub_id(model):
            raise ValueError(
                f"Model path {model!r} does not exist. Set `model` (--model) to a Hugging Face checkpoint "
                f"directory (with config.json), a .gguf file, a directory holding one .gguf file, or a "
                f"hub id like 'org/name'.")
        local = hub_snapshot(model, field="model")
    kind, path = _classify_local(local, model)
    return ResolvedModel(kind=kind, path=path, tokenizer_path=tokenizer_path, model_arg=model)


def looks_like_hub_id(name: str) -> bool:
    """True for strings shaped like a hub repo id ``org/name`` (not like a filesystem path)."""
    return bool(_HUB_ID_RE.match(name)) and not name.startswith((".", "~"))


def hub_snapshot(repo_id: str, field: str) -> Path:
    """Download (or find in the local HF cache) the snapshot of ``repo_id``.

    The local cache is tried first so a cached repo needs no network. ``HF_HUB_OFFLINE=1`` is
    honoured by huggingface_hub itself; without network the call fails within about a second
    (DNS failure) or ``HUB_ETAG_TIMEOUT_S`` (unreachable host).

    Raises:
        ValueError: naming ``field`` and ``repo_id`` when the snapshot cannot be had.
    """
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub ships with transformers
        raise ValueError(
            f"{field}={repo_id!r} is not a local path and huggingface_hub is not installed.") from e
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, ignore_patterns=_HUB_IGNORE_PATTERNS))
    except Exception:
        pass  # not cached: try the hub below
    try:
        return Path(snapshot_download(repo_id, etag_timeout=HUB_ETAG_TIMEOUT_S,
                                      ignore_patterns=_HUB_IGNORE_PATTERNS))
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{field}={repo_id!r} is not a local path, and fetching it from the Hugging Face hub failed "
            f"({type(e).__name__}: {reason}). Pass a local checkpoint directory or .gguf file as "
            f"`{field}`, or check the hub id and your network / HF_HUB_OFFLINE setting.") from e


def _classify_local(local: Path, model: str) -> tuple[str, Path]:
    """Return (kind, absolute path) for an existing file or directory, or raise ValueError."""
    local = local.resolve()
    if local.is_file():
        if local.suffix.lower() == ".gguf":
            return "gguf", local
        raise ValueError(
            f"Model path {model!r} is a file but not a .gguf file. Set `model` to a checkpoint directory "
            f"(with config.json) or a .gguf file.")
    from engine.loader.ct2 import is_ct2_whisper_dir
    if is_ct2_whisper_dir(local):       # faster-whisper: model.bin (its config.json is CTranslate2's)
        return "ct2", local
    if (local / "config.json").is_file():
        return "hf", local
    ggufs = sorted(p for p in local.iterdir() if p.is_file() and p.suffix.lower() == ".gguf")
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ValueError(
            f"Model path {model!r} holds {len(ggufs)} .gguf files ({names}); set `model` to the one to load.")
    raise ValueError(
        f"Model path {model!r} has no config.json and no .gguf file. Set `model` to a Hugging Face "
        f"checkpoint directory, a .gguf file, or a directory holding one .gguf file.")


def _resolve_tokenizer(tokenizer: str) -> Path:
    """An existing tokenizer directory, or a hub id fetched with ``hub_snapshot``."""
    local = Path(tokenizer).expanduser()
    if local.is_dir():
        return local.resolve()
    if local.is_file():
        raise ValueError(f"Tokenizer path {tokenizer!r} is a file; set `tokenizer` to a tokenizer directory.")
    if looks_like_hub_id(tokenizer):
        return hub_snapshot(tokenizer, field="tokenizer")
    raise ValueError(
        f"Tokenizer path {tokenizer!r} does not exist. Set `tokenizer` (--tokenizer) to a directory "
        f"with tokenizer files or a hub id, or leave it unset to use the model's tokenizer.")
