"""Decode attention over the paged KV cache on CPU: ``csrc/decode_attention.c`` through ctypes.

Semantics (the C file's header has the loop): each request's one query token attends over the first
``seq_lens[r]`` slots of its blocks (the last ``window`` of them under a sliding window, the blocks before
never read), query head h reading KV head ``h // (num_heads // num_kv_heads)``.
The torch twin is ``kernels.reference.paged_attention_ref`` with one query token per request.

Why: the torch path gathers each decode row's blocks into a padded copy and runs SDPA over it; at 16 rows the
copy is half of attention's time, and the context is read from memory twice. The kernel reads each block in
place, once, for all heads (benchmarks/RESULTS.md, "What sets the CPU defaults").
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from kernels import cpu_native
from kernels.cpu_native import CACHE_DTYPES
from kernels.utils import cdiv, check_int, check_tensor

MAX_HEADS = 256
"""Query heads the kernel supports (its per-head running sums live on the stack)."""
MAX_BLOCK_SIZE = 256
"""Block size the kernel supports."""

_CPU = torch.device("cpu")
_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
_ARGTYPES = [_P, _I64, _P, _P, _I32, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _F, _I64, _I64, _P, _P, _I32,
             _I64]


def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
    """Whether the kernel handles a model's attention shape and KV cache dtype (else the torch path runs)."""
    return (dtype in CACHE_DTYPES and num_kv_heads > 0 and num_heads % num_kv_heads == 0
            and num_heads <= MAX_HEADS and head_dim % 8 == 0 and block_size % 8 == 0
            and block_size <= MAX_BLOCK_SIZE)


class CpuDecodeAttention:
    """The loaded kernel. ``chunk_tokens``: keys per work item (rounded up to whole blocks): a request's
    context is cut into chunks of that many keys so that one long request still spreads over all threads."""

    def __init__(self, lib: ctypes.CDLL, chunk_tokens: int) -> None:
        self._fn = lib.chorus_decode_attention
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = None
        self.chunk_tokens = check_int("chunk_tokens", chunk_tokens, min_value=1)
        self._checked_caches: set[tuple] = set()
        """Caches (by address, shapes and dtypes) that passed ``_check_caches``."""

    @classmethod
    def load(cls, build_dir: Path, chunk_tokens: int) -> Optional["CpuDecodeAttention"]:
        """Build (once per host, into ``build_dir``) and load the kernel; None where it cannot be built."""
        lib = cpu_native.load("decode_attention", build_dir)
        return cls(lib, chunk_tokens) if lib is not None else None

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                 num_threads: Optional[int] = None, window: Optional[int] = None) -> torch.Tensor:
        """q: [num_reqs, num_heads, head_dim] float32 (one query token per request; each row's heads
        contiguous); caches: [num_blocks, block_size, num_kv_heads, head_dim] float32 or bfloat16; block_tables:
        [num_reqs, >= cdiv(max_seq_len, block_size)] int32; seq_lens: [num_reqs] int32, each in
        [1, max_seq_len] (``max_seq_len`` is their host max; not checked on the tensor: the caller's invariant);
        window: the sliding window, keys before seq_len - window neither weighted nor (their blocks) read (None:
        all keys). Returns out [num_reqs, num_heads, head_dim] float32."""
        check_tensor("q", q, ndim=3, dtypes=(torch.float32,), device=_CPU)
        num_reqs, num_heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            raise ValueError(f"q: each row's heads must be contiguous, got strides {q.stride()} for shape "
                             f"{tuple(q.shape)}.")
        key = (k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape, v_cache.shape, k_cache.dtype, v_cache.dtype)
        if key not in self._checked_caches:            # a layer's caches: checked once, not on every call
            self._check_caches(k_cache, v_cache, num_heads, head_dim)
            self._checked_caches.add(key)
        _, block_size, num_kv_heads, _ = k_cache.shape
        max_seq_len = check_int("max_seq_len", max_seq_len, min_value=1)
        if window is not None:
            check_int("window", window, min_value=1)
        num_blocks = cdiv(max_seq_len, block_size)
        check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), shape=(num_reqs,), device=_CPU, contiguous=True)
        check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=_CPU,
                     last_dim_contiguous=True)
        if block_tables.shape[0] < num_reqs or block_tables.shape[1] < num_blocks:
            raise ValueError(f"block_tables: shape {tuple(block_tables.shape)} has fewer than {num_reqs} "
                             f"rows or {num_blocks} columns (cdiv(max_seq_len, block_size)).")
        chunk_blocks = cdiv(self.chunk_tokens, block_size)
        max_chunks = cdiv(num_blocks, chunk_blocks)
        out = torch.empty(num_reqs, num_heads, head_dim)
        items = num_reqs * max_chunks * num_heads
        scratch = torch.empty(items * (head_dim + 2))      # [items, head_dim] outputs, then [items, 2] (max, sum)
        self._fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.dtype == torch.bfloat16,
                 block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), num_reqs,
                 num_heads, num_kv_heads, head_dim, block_size, float(scale), chunk_blocks, max_chunks,
                 scratch.data_ptr(), scratch.data_ptr() + 4 * items * head_dim,
                 num_threads or torch.get_num_threads(), window or 0)
        return out

    @staticmethod
    def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, head_dim: int) -> None:
        check_tensor("k_cache", k_cache, ndim=4, dtypes=CACHE_DTYPES, device=_CPU, contiguous=True)
        _, block_size, num_kv_heads, _ = k_cache.shape
        check_tensor("k_cache", k_cache, shape=(None, None, None, head_dim))
        check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape), contiguous=True)
        if not supports(num_heads, num_kv_heads, head_dim, block_size, k_cache.dtype):
            raise ValueError(f"heads {num_heads}/{num_kv_heads}, head_dim {head_dim}, block_size "
                             f"{block_size}: need num_heads % num_kv_heads == 0, num_heads <= {MAX_HEADS}, "
                             f"head_dim and block_size multiples of 8, block_size <= {MAX_BLOCK_SIZE}.")
