"""Adapters resolved by name: ``--lora-dir DIR`` (vLLM's filesystem LoRA resolver).

A request whose ``model`` is neither a served name nor a registered adapter is offered to the
resolvers, in order; the first that maps the name to a directory wins, and the adapter is loaded from
there on first use (then registered as one loaded by ``/v1/load_lora_adapter``). ``LoRAResolver`` is the
interface: a hub resolver (download, then a local path) can plug in the same way.

``FilesystemLoRAResolver`` answers ``DIR/NAME`` for a NAME that is one plain path component (no '/',
'\\', NUL, not '.', '..' nor hidden), whose resolved path (symlinks and '..' followed) is a directory
under the resolved DIR: no request makes the server read outside the directories it was given. A name
it refuses and a name with no directory are alike (None: the caller's 404).
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Protocol, Sequence, runtime_checkable

from engine.server.lora_paths import path_under_roots, resolve_allowed_roots

logger = logging.getLogger("chorus.server")

MAX_NAME_CHARS = 255
"""Longest adapter name a filesystem resolver looks up (a file name's limit on common filesystems)."""
ADAPTER_CONFIG = "adapter_config.json"


@runtime_checkable
class LoRAResolver(Protocol):
    """Maps an adapter name to a local PEFT directory. Both methods may touch the disk (callers run
    them off the event loop) and must not raise for odd names."""

    def resolve(self, name: str) -> Optional[str]:
        """The adapter's directory (an absolute path), or None: this resolver does not know ``name``."""
        ...

    def list_names(self) -> list[str]:
        """Names ``resolve`` would answer, without loading anything (``/v1/models?all=true``)."""
        ...


def is_plain_name(name: object) -> bool:
    """``name`` is one path component that cannot leave its directory: non-empty, at most
    ``MAX_NAME_CHARS``, no separator, NUL or control character, not hidden ('.', '..', '.x')."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        return False
    if name.startswith(".") or "/" in name or "\\" in name or os.sep in name or (os.altsep and os.altsep in name):
        return False
    return all(ch.isprintable() for ch in name)


class FilesystemLoRAResolver:
    """``DIR/NAME`` for adapters kept as subdirectories of ``DIR`` (``--lora-dir``).

    Args:
        lora_dir: an existing directory (ValueError naming ``--lora-dir`` otherwise); resolved once.
    """

    def __init__(self, lora_dir: str) -> None:
        self.root = resolve_allowed_roots([lora_dir], flag="--lora-dir")[0]

    def resolve(self, name: str) -> Optional[str]:
        if not is_plain_name(name):
            return None
        try:
            resolved = path_under_roots(os.path.join(self.root, name), [self.root])
            if resolved is None or resolved == self.root or not os.path.isdir(resolved):
                if resolved is None:
                    logger.warning("LoRA adapter %r: %s/%s leads outside --lora-dir; refused.",
                                   name, self.root, name)
                return None
        except (OSError, ValueError):
            return None
        return resolved

    def list_names(self) -> list[str]:
        try:
            entries = sorted(os.listdir(self.root))
        except OSError as e:
            logger.warning("--lora-dir %s cannot be listed: %s", self.root, e)
            return []
        names = []
        for name in entries:
            path = self.resolve(name)
            if path is not None and os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
                names.append(name)
        return names

    def __repr__(self) -> str:
        return f"FilesystemLoRAResolver({self.root!r})"


def filesystem_resolvers(lora_dirs: Optional[Sequence[str]]) -> list[LoRAResolver]:
    """One ``FilesystemLoRAResolver`` per ``--lora-dir`` (in order: the first that knows a name wins);
    ValueError naming the flag for a directory that does not exist."""
    return [FilesystemLoRAResolver(d) for d in lora_dirs or []]
