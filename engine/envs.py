"""Every environment variable Chorus reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """CHORUS_CACHE: where downloaded models and converted checkpoints live (~/.cache/chorus)."""
    return Path(os.environ.get("CHORUS_CACHE", Path.home() / ".cache" / "chorus")).expanduser()


def cpu_kernel_dir() -> Path:
    """Where the CPU C kernels are built once per host (``kernels.cpu_native``): CHORUS_CACHE/cpu_kernels."""
    return cache_dir() / "cpu_kernels"


def api_key() -> str | None:
    """CHORUS_API_KEY: the key /v1/* routes require (same as --api-key)."""
    return os.environ.get("CHORUS_API_KEY") or None


def allow_runtime_lora_updating() -> bool:
    """CHORUS_ALLOW_RUNTIME_LORA_UPDATING=1 enables /v1/load_lora_adapter and /v1/unload_lora_adapter."""
    return os.environ.get("CHORUS_ALLOW_RUNTIME_LORA_UPDATING", "0").lower() in ("1", "true", "yes")


def num_threads() -> int | None:
    """CHORUS_NUM_THREADS: torch intra-op threads on CPU (default: torch's choice)."""
    v = os.environ.get("CHORUS_NUM_THREADS")
    return int(v) if v else None


def rendezvous() -> tuple[str | None, int | None]:
    """MASTER_ADDR / MASTER_PORT (torch.distributed's env:// names, which torchrun sets): where the
    tensor-parallel ranks meet; each None when unset (then localhost and a free port)."""
    port = os.environ.get("MASTER_PORT")
    return os.environ.get("MASTER_ADDR") or None, int(port) if port else None


def kernel_policy() -> str | None:
    """CHORUS_KERNEL_POLICY: overrides of the engine's fast-path choices, for experiments and A/B
    runs, e.g. "gemm_split_k=0,attn_decode.tile_n=64" (fields of ``engine.kernel_policy.KernelPolicy``;
    a bad item stops start-up with the accepted fields). Unset: the measured defaults."""
    return os.environ.get("CHORUS_KERNEL_POLICY") or None
