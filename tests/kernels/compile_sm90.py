"""Run a script that compiles Triton kernels for sm_90 (H100 / H200) with no GPU: Triton's bundled ptxas,
in a process without TRITON_INTERPRET (the interpreter does not type-check what the compiler does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_compile_script(script: str, cache_dir: Path, timeout_s: int = 600) -> str:
    """stdout of ``python -c script`` from the repository root with its own Triton cache; AssertionError
    with the end of stderr if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
