"""Host memory: what a CPU engine frees between steps stays mapped for the next step (glibc's malloc),
and a CUDA engine's page-locked memory is registered rather than allocated pinned.

A prompt step on CPU allocates tens of MB of activations per layer and frees them. glibc hands
blocks over its mmap threshold back to the kernel on ``free`` and trims the heap top over its
trim threshold, so every such step page-faults its activations back in (the counts and their cost:
benchmarks/RESULTS.md, "What sets the CPU defaults"). Raising both thresholds
once keeps the freed memory in the heap, where the next step's allocations reuse it; the resident
set stays at its peak instead of shrinking between steps.

The thresholds are process-wide and only ever raised here; a user who tunes glibc's malloc through
the environment (``MALLOC_*_`` variables or ``GLIBC_TUNABLES``) keeps their settings.

A CUDA engine page-locks every adapter it reads (the host store's copies, so slot loads are
asynchronous copies). PyTorch's pinned allocator takes new blocks from ``cudaHostAlloc`` by default,
which page-locks slower than the file is read from the page cache, under one driver lock that the
loader threads share. With ``pinned_use_cuda_host_register`` it maps the block, touches its pages on
``PINNED_REGISTER_THREADS`` threads and registers it (``cudaHostRegister``), several times faster
(``benchmarks/RESULTS.md``, "Adapters at scale"); freed blocks are cached and reused either way. ``register_pinned_host_memory`` sets that unless the environment already
sets a ``pinned_`` option of PyTorch's allocator.
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

PINNED_REGISTER_THREADS = 8
"""Threads that touch a new page-locked block's pages before it is registered (PyTorch's measured best)."""
_ALLOC_CONF_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

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


def register_pinned_host_memory() -> bool:
    """Make PyTorch's page-locked host blocks come from ``cudaHostRegister`` of mapped memory, touched on
    ``PINNED_REGISTER_THREADS`` threads, instead of ``cudaHostAlloc`` (process-wide; call before the first
    pinned allocation). Returns whether it was set: False when ``PYTORCH_CUDA_ALLOC_CONF`` or
    ``PYTORCH_ALLOC_CONF`` already sets a ``pinned_`` option."""
    if any("pinned_" in os.environ.get(name, "") for name in _ALLOC_CONF_ENV):
        return False
    import torch

    settings = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{PINNED_REGISTER_THREADS}"
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if set_settings is None:                    # torch < 2.12
        set_settings = torch.cuda.memory._set_allocator_settings
    set_settings(settings)
    return True
