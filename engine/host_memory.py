"""Host memory that a CPU engine frees between steps stays mapped for the next step (glibc's malloc).

A prompt step on CPU allocates tens of MB of activations per layer and frees them. glibc hands
blocks over its mmap threshold back to the kernel on ``free`` and trims the heap top over its
trim threshold, so every such step page-faults its activations back in (the counts and their cost:
benchmarks/RESULTS.md, "What sets the CPU defaults"). Raising both thresholds
once keeps the freed memory in the heap, where the next step's allocations reuse it; the resident
set stays at its peak instead of shrinking between steps.

The thresholds are process-wide and only ever raised here; a user who tunes glibc's malloc through
the environment (``MALLOC_*_`` variables or ``GLIBC_TUNABLES``) keeps their settings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger("chorus.host_memory")

MMAP_THRESHOLD_BYTES = 32 << 20
"""Allocations up to this size come from the heap, not their own mapping (glibc's largest allowed
value on 64-bit; larger ones, e.g. an 8,192-token chunk's MLP activations, still map and unmap, but
their faults are small next to that step's compute)."""
TRIM_THRESHOLD_BYTES = 1 << 30
"""Free memory at the heap top kept rather than returned to the kernel: above a prompt step's peak."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3      # mallopt parameters (malloc.h)
_ENV_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_host_memory() -> bool:
    """Set glibc's mmap and trim thresholds (``MMAP_THRESHOLD_BYTES``, ``TRIM_THRESHOLD_BYTES``).
    Returns whether they were set: False off glibc, or when the environment already tunes malloc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in _ENV_SETTINGS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
          and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not ok:
        logger.warning("mallopt refused the mmap/trim thresholds; CPU prompt steps will page-fault their "
                       "activations back in each step")
    return ok
