"""Build and load the C kernels of ``kernels/csrc`` for the CPU path (no torch headers: plain C and ctypes).

``load(name, build_dir)`` compiles ``csrc/<name>.c`` once per source, compiler and host CPU with the system
C compiler (``CC``, else ``cc``) at ``-O3 -march=native -fopenmp`` into ``build_dir``, then loads it with
ctypes; later processes load the cached library (a file rename makes each appear whole). Any failure (no compiler, a
compile error, a host without OpenMP) logs one warning and returns None: callers keep their torch path.

The library links ``libgomp.so.1``, the OpenMP runtime torch's CPU wheels load first, so the kernels share
torch's thread pool; callers pass ``torch.get_num_threads()`` to each call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger("chorus.kernels")

CSRC = Path(__file__).parent / "csrc"
CACHE_DTYPES = (torch.float32, torch.bfloat16)
"""KV cache dtypes the C kernels read and write (their math is float32 either way)."""
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
_loaded: dict[tuple[str, str], Optional[ctypes.CDLL]] = {}


def _host_key() -> str:
    """The host's CPU model and flags: a library built with -march=native runs only where they match."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features"))][:2]
    return "\n".join(keep) or platform.machine()


def library_path(name: str, build_dir: Path, compiler: str) -> Path:
    """Where ``csrc/<name>.c`` built by ``compiler`` for this host lives in ``build_dir``."""
    key = hashlib.sha256()
    headers = [p.read_bytes() for p in sorted(CSRC.glob("*.h"))]                  # what any source includes
    for part in ((CSRC / f"{name}.c").read_bytes(), *headers, compiler.encode(), " ".join(FLAGS).encode(),
                 _host_key().encode()):
        key.update(part)
        key.update(b"\0")
    return Path(build_dir) / f"{name}-{key.hexdigest()[:16]}.so"


def load(name: str, build_dir: Path) -> Optional[ctypes.CDLL]:
    """``csrc/<name>.c`` as a loaded library (built into ``build_dir`` if needed); None where it cannot be."""
    cache_key = (name, str(build_dir))
    if cache_key not in _loaded:
        _loaded[cache_key] = _build_and_load(name, Path(build_dir))
    return _loaded[cache_key]


def _build_and_load(name: str, build_dir: Path) -> Optional[ctypes.CDLL]:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("No C compiler (CC or cc) on PATH: CPU kernel %s is off; the torch path runs instead. "
                       "Install gcc to enable it.", name)
        return None
    path = library_path(name, build_dir, compiler)
    if not path.exists():
        try:
            build_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=build_dir)
            os.close(fd)
            cmd = [compiler, *FLAGS, str(CSRC / f"{name}.c"), "-o", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                os.unlink(tmp)
                logger.warning("Building CPU kernel %s failed (%s); the torch path runs instead:\n%s", name,
                               " ".join(cmd), done.stderr[-2000:])
                return None
            os.replace(tmp, path)
        except (OSError, subprocess.SubprocessError) as e:
            logger.warning("Building CPU kernel %s failed (%s); the torch path runs instead.", name, e)
            return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        logger.warning("Loading CPU kernel %s from %s failed (%s); the torch path runs instead.", name, path,
                       e)
        return None
