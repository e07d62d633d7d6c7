"""Where a client may have the server read an adapter from: ``--allowed-lora-path``.

A ``lora_path`` sent to ``/v1/load_lora_adapter`` is resolved (``os.path.realpath``: symlinks and
``..`` followed) and must lie under one of the resolved roots. The verdict does not depend on whether
the path exists, and callers answer every refusal with one message, so a client learns nothing about
the server's files. The operator's own paths (``--lora-modules``) are not restricted.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence


def resolve_allowed_roots(dirs: Sequence[str], flag: str = "--allowed-lora-path") -> list[str]:
    """The roots, resolved; ValueError naming ``flag`` for one that is not an existing directory."""
    roots = []
    for d in dirs:
        try:
            resolved = os.path.realpath(os.path.expanduser(d))
            is_dir = os.path.isdir(resolved)
        except (OSError, ValueError):
            resolved, is_dir = d, False
        if not is_dir:
            raise ValueError(f"{flag} {d}: no such directory; give existing directories that hold the adapters "
                             "clients may load (each adapter a PEFT directory inside one of them).")
        roots.append(resolved)
    return roots


def path_under_roots(path: str, roots: Sequence[str]) -> Optional[str]:
    """``path`` resolved (relative to the working directory) if it lies under one of ``roots``
    (resolved ones, ``resolve_allowed_roots``), else None; never raises on odd input (NUL bytes,
    surrogates, overlong names)."""
    if not isinstance(path, str) or not path:
        return None
    try:
        resolved = os.path.realpath(path)
        for root in roots:
            if os.path.commonpath([resolved, root]) == root:
                return resolved
    except (OSError, ValueError):
        return None
    return None
