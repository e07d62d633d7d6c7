"""Every environment variable Chorus reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """CHORUS_CACHE: where downloaded models and converted checkpoints live (~/.cache/chorus)."""
    return Path(os.environ.get("CHORUS_CACHE", Path.home() / ".cache" / "chorus")).expanduser()


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


def lora_shrink_config() -> str | None:
    """CHORUS_LORA_SHRINK_CONFIG: LoRA shrink launch overrides, e.g. "block_k=128,split_k=8"
    (fields of ``kernels.lora_shrink.LoRAShrinkConfig``; for benchmarks and tuning)."""
    return os.environ.get("CHORUS_LORA_SHRINK_CONFIG") or None


def lora_expand_config() -> str | None:
    """CHORUS_LORA_EXPAND_CONFIG: LoRA expand launch overrides, e.g. "block_n=128,n_tiles=2"
    (fields of ``kernels.lora_expand.LoRAExpandConfig``)."""
    return os.environ.get("CHORUS_LORA_EXPAND_CONFIG") or None


def gemm_split_k() -> bool:
    """CHORUS_GEMM_SPLIT_K: 1 (default) runs o_proj and down_proj of decode-sized steps on CUDA as
    one batched GEMM over two halves of K whose partials the next add + RMSNorm sums
    (``engine.layers.fused.split_k_parts``); 0 runs them as plain cuBLAS GEMMs."""
    raw = os.environ.get("CHORUS_GEMM_SPLIT_K", "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"CHORUS_GEMM_SPLIT_K={raw!r}: use 0 or 1.")
    return raw == "1"


def decode_fuse_rotary() -> str:
    """CHORUS_DECODE_FUSE_ROTARY: where a pure-decode step on CUDA runs its rotary + KV write inside
    the decode attention kernel (``kernels.paged_attention.paged_decode_rotary``, one launch per
    layer instead of two): ``auto`` (default) for batches whose requests x KV heads do not fill the
    SMs (``decode_rotary_pays``: on an H200 batch 1 gains ~2%, batch 256 loses ~3%), ``1`` for every
    pure-decode batch, ``0`` never."""
    raw = os.environ.get("CHORUS_DECODE_FUSE_ROTARY", "auto").strip().lower()
    if raw not in ("auto", "0", "1"):
        raise ValueError(f"CHORUS_DECODE_FUSE_ROTARY={raw!r}: use auto, 0 or 1.")
    return raw


def attn_decode_config() -> dict[str, int]:
    """CHORUS_ATTN_DECODE_CONFIG: decode attention tile overrides, e.g. "tile_n=64,num_warps=4,
    num_stages=2,heads_first=0,heads_per_prog=1" (heads_per_prog=0: pure-decode batches take the
    general kernel; ``benchmarks/sweeps/attention_sweep.py`` passes candidates directly instead)."""
    raw = os.environ.get("CHORUS_ATTN_DECODE_CONFIG", "")
    out: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in raw.split(","))):
        key, _, val = item.partition("=")
        ok = val.isdigit() and (int(val) in (0, 1) if key == "heads_first" else
                                int(val) in (0, 1, 2, 4, 8) if key == "heads_per_prog" else
                                key in ("tile_n", "num_warps", "num_stages") and int(val) >= 1)
        if not ok:
            raise ValueError(f"CHORUS_ATTN_DECODE_CONFIG: bad item {item!r}; use tile_n=, num_warps=, "
                             f"num_stages= with positive integers, heads_first= 0 or 1, heads_per_prog= "
                             f"0, 1, 2, 4 or 8.")
        out[key] = int(val)
    return out


def decode_gemv_max_tokens() -> int:
    """CHORUS_DECODE_GEMV_MAX_TOKENS: on CUDA, steps of at most this many tokens run their
    projections as ``kernels.gemv`` launches fused with the norm / SiLU-and-mul before them
    (``engine.layers.fused``); 0 turns that off (cuBLAS + separate kernels). Default 2: the H200
    sweep (``benchmarks/sweeps/gemv_sweep.py``) has the fused kernels on a par or ahead at 1-2 rows and
    behind from 4 rows on, where rebuilding the input per program costs more than a launch."""
    raw = os.environ.get("CHORUS_DECODE_GEMV_MAX_TOKENS", "2")
    if not raw.isdigit() or int(raw) > 16:
        raise ValueError(f"CHORUS_DECODE_GEMV_MAX_TOKENS={raw!r}: use an integer from 0 to 16.")
    return int(raw)


def gemv_config() -> dict[str, int]:
    """CHORUS_GEMV_CONFIG: decode GEMV launch overrides, e.g. "block_n=32,block_k=256,num_warps=4,
    num_stages=3" (fields of ``kernels.gemv.GemvConfig``; use_dot=0/1 too), which
    ``engine.layers.fused`` passes to the ``kernels.gemv`` wrappers (``benchmarks/sweeps/gemv_sweep.py``
    passes candidates directly instead)."""
    raw = os.environ.get("CHORUS_GEMV_CONFIG", "")
    out: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in raw.split(","))):
        key, _, val = (p.strip() for p in item.partition("="))
        ok = val.isdigit() and (int(val) in (0, 1) if key == "use_dot" else int(val) >= 1)
        if key not in ("block_n", "block_k", "num_warps", "num_stages", "use_dot") or not ok:
            raise ValueError(f"CHORUS_GEMV_CONFIG: bad item {item!r}; use block_n=, block_k=, num_warps=, "
                             f"num_stages= with positive integers (and use_dot=0 or 1).")
        out[key] = int(val)
    return out


def _on_off(name: str, on: str, off: str) -> bool:
    """A "0"/"1" switch that defaults to 1 (surrounding spaces ignored); ValueError naming both
    meanings otherwise."""
    value = os.environ.get(name, "")
    flag = value.strip() or "1"
    if flag not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: use 1 ({on}) or 0 ({off}), or unset it for 1.")
    return flag == "1"


def lora_overlap() -> bool:
    """CHORUS_LORA_OVERLAP: "1" (default) issues each CUDA layer's LoRA shrink on a side stream
    before the base GEMM, so the two run concurrently, and joins before the expand (Triton LoRA
    path; ``lora.layers``); "0" runs GEMM, shrink and expand one after another."""
    return _on_off("CHORUS_LORA_OVERLAP", "overlap", "sequential")


def lora_fuse_silu_mul() -> bool:
    """CHORUS_LORA_FUSE_SILU_MUL: "1" (default) adds the gate/up projection's LoRA update inside
    the SiLU-and-mul that follows it (``kernels.lora_expand_silu_mul``: one launch, and the
    [tokens, 2 x intermediate] output is read once instead of read, written and read again); "0"
    runs the expand into the projection output, then SiLU-and-mul. Applies on the Triton split path
    with the overlap on (``lora.layers``)."""
    return _on_off("CHORUS_LORA_FUSE_SILU_MUL", "fused", "expand, then SiLU-and-mul")


def lora_fuse_rotary() -> bool:
    """CHORUS_LORA_FUSE_ROTARY: "1" (default) adds the q/k/v projection's LoRA update inside the
    rotary + KV-write kernel after it on decode-sized CUDA steps (``kernels.lora_rotary_write_kv``:
    one launch instead of expand + rotary/write); "0" runs the expand into the projection output
    first (``lora.layers``)."""
    return _on_off("CHORUS_LORA_FUSE_ROTARY", "fused", "expand, then rotary + KV write")


def lora_fuse_norm() -> bool:
    """CHORUS_LORA_FUSE_NORM: "1" (default) adds the o_proj and down_proj LoRA updates inside the
    residual add + RMSNorm after them on decode-sized steps (``kernels.lora_expand_norm``: one launch
    instead of expand + add/norm); "0" runs the expand into the projection output first
    (``lora.layers``)."""
    return _on_off("CHORUS_LORA_FUSE_NORM", "fused", "expand, then add + RMSNorm")


def lora_stacked_tune() -> bool:
    """CHORUS_LORA_STACKED_TUNE: at start-up on CUDA, time how many slots the stacked decode GEMM of
    the few-adapters CUDA graphs should cover (``LoRAManager.tune_stacked_cover``). Default on; 0
    keeps the graphs' slot bound."""
    return _on_off("CHORUS_LORA_STACKED_TUNE", "timed at start-up", "the slot bound")


def lora_stacked_max_tokens() -> int:
    """CHORUS_LORA_STACKED_MAX_TOKENS: on CUDA, a step of at most this many tokens (decode) computes
    every adapted projection's LoRA shrink inside its base GEMM: the slots' A rows sit under the
    base weight in one tensor, so one cuBLAS GEMM gives the base output and every covered slot's
    x @ A.T, and the expand picks each token's own (``lora.layers``: no shrink launch, the A bytes
    streamed at the GEMM's bandwidth). Default 128; 0 turns it off (the shrink kernel then runs
    beside the GEMM, CHORUS_LORA_OVERLAP)."""
    raw = os.environ.get("CHORUS_LORA_STACKED_MAX_TOKENS", "128").strip()
    if not raw.isdigit() or int(raw) > 1024:
        raise ValueError(f"CHORUS_LORA_STACKED_MAX_TOKENS={raw!r}: use an integer from 0 to 1024.")
    return int(raw)
